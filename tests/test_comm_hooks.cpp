// Communication hooks: a hook of the user's own sees each bucket once per step, with its
// parameters and their shapes, issues tagged collectives and leaves the average; PowerSGD at full
// rank equals the plain average, at low rank moves fewer values, keeps every rank bitwise equal,
// carries its error to the next step and trains the MLP close to the uncompressed run; the hook
// is agreed across ranks like every other setting.
#include <gradsync/backend/local.hpp>
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/reduction/powersgd.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/half_gradients.hpp"
#include "support/temp_dir.hpp"

#include <algorithm>  // for std::sort
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <utility>  // for std::pair
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace {

// Weights with shapes and a bias, gradients that differ by rank and step.
struct Matrices {
    struct Tensor {
        std::string name;
        std::vector<std::size_t> shape;
        std::vector<float> w, g;
    };
    std::vector<Tensor> tensors;

    explicit Matrices(const std::vector<std::vector<std::size_t>>& shapes) {
        for (std::size_t k = 0; k < shapes.size(); ++k) {
            std::size_t n = 1;
            for (auto d : shapes[k]) n *= d;
            tensors.push_back({"m" + std::to_string(k), shapes[k], std::vector<float>(n, 0.5f), std::vector<float>(n)});
        }
    }
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        for (auto& t : tensors) out.push_back(gradsync::parameter(t.name, t.w, t.g, t.shape));
        return out;
    }
    void fill(int rank, int step) {
        for (std::size_t k = 0; k < tensors.size(); ++k)
            for (std::size_t i = 0; i < tensors[k].g.size(); ++i)
                tensors[k].g[i] = mlp::uniform(static_cast<std::uint64_t>(rank) * 1000003u +
                                               static_cast<std::uint64_t>(step) * 7919u + k * 104729u + i) -
                                  0.5f;
    }
    std::vector<std::vector<float>> grads() const {
        std::vector<std::vector<float>> out;
        for (const auto& t : tensors) out.push_back(t.g);
        return out;
    }
};

const std::vector<std::vector<std::size_t>> shapes{{6, 4}, {5}, {3, 8}};

// The gradients every rank holds after each of `steps` synchronize() calls, with these policies.
template <class... Policies>
std::vector<std::vector<std::vector<std::vector<float>>>> run(int world, int steps, Policies... policies) {
    std::vector<std::vector<std::vector<std::vector<float>>>> out(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        Matrices model(shapes);
        gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{128}},
                                  policies...);
        for (int s = 0; s < steps; ++s) {
            model.fill(backend.rank(), s);
            dp.synchronize();
            out[static_cast<std::size_t>(backend.rank())].push_back(model.grads());
        }
    });
    return out;
}

// A hook of a test's own: the plain average, as sum then divide, noting what it was shown.
// [hook]
struct NotingHook {
    using policy_category = gradsync::policy_category::comm_hook;
    static constexpr bool hooked = true;
    struct Seen {
        std::size_t bucket;
        std::int64_t step;
        std::vector<std::string> names;
        std::vector<std::vector<std::size_t>> shapes;
        std::vector<std::size_t> offsets;
        std::size_t count;
        bool finished;
    };
    std::vector<Seen>* seen = nullptr;

    [[nodiscard]] std::string settings() const { return "noting sum"; }
    gradsync::HookComm::Pending start(const gradsync::HookBucket& bucket, gradsync::HookComm& comm) {
        Seen s{bucket.index, bucket.step, {}, {}, {}, bucket.values.size(), false};
        for (const auto& p : bucket.parameters) {
            s.names.push_back(p.name);
            s.shapes.push_back(p.shape);
            s.offsets.push_back(p.offset);
        }
        seen->push_back(s);
        return comm.allreduce_async(bucket.values, gradsync::ReduceOp::sum);
    }
    void finish(const gradsync::HookBucket& bucket, gradsync::HookComm& comm) {
        for (float& v : bucket.values) v /= static_cast<float>(comm.size());
        for (auto& s : *seen)
            if (s.bucket == bucket.index && s.step == bucket.step) s.finished = true;
    }
};
// [/hook]
static_assert(gradsync::CommHook<NotingHook>);
static_assert(gradsync::CommHook<gradsync::PowerSGD>);
static_assert(gradsync::CommHook<gradsync::AllreduceHook>);

double max_difference(const std::vector<float>& a, const std::vector<float>& b) {
    double d = 0;
    for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(double(a[i]) - double(b[i])));
    return d;
}

}  // namespace

TEST_CASE("a hook of the user's own sees every bucket once per step with its parameters, and leaves the average") {
    std::vector<std::vector<NotingHook::Seen>> seen(3);
    std::vector<std::vector<std::vector<float>>> hooked(3);
    gradsync::spawn(3, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        Matrices model(shapes);
        gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{128}},
                                  NotingHook{&seen[r]});
        for (int s = 0; s < 2; ++s) {
            model.fill(backend.rank(), s);
            dp.synchronize();
        }
        hooked[r] = model.grads();
        CHECK(dp.plan().buckets.size() == 2);  // {m2} and {m0, m1}
    });
    const auto plain = run(3, 2);
    for (std::size_t r = 0; r < 3; ++r) {
        CAPTURE(r);
        REQUIRE(seen[r].size() == 4);  // 2 buckets, 2 steps
        std::size_t elements = 0;
        for (const auto& s : seen[r]) {
            CHECK(s.finished);
            if (s.step == 1) elements += s.count;
        }
        CHECK(elements == 6 * 4 + 5 + 3 * 8);
        const auto& first = seen[r].front();  // the plan's first bucket: the last parameter
        CHECK(first.bucket == 0);
        CHECK(first.step == 1);
        CHECK(first.names == std::vector<std::string>{"m2"});
        CHECK(first.count == 24);
        const auto& last = seen[r].back();  // the others, in element order
        CHECK(last.bucket == 1);
        CHECK(last.step == 2);
        CHECK(last.names == std::vector<std::string>{"m0", "m1"});
        CHECK(last.shapes == std::vector<std::vector<std::size_t>>{{6, 4}, {5}});
        CHECK(last.offsets == std::vector<std::size_t>{0, 24});
        CHECK(last.count == 24 + 5);
        // Sum then divide by 3 rounds as the plain average does on LocalBackend (sum, then / 3).
        for (std::size_t k = 0; k < hooked[r].size(); ++k) CHECK(max_difference(hooked[r][k], plain[r][1][k]) < 1e-6);
        CHECK(hooked[r] == hooked[0]);
    }
}

TEST_CASE("AllreduceHook averages exactly as DataParallel does without a hook, bitwise, also overlapped") {
    const auto plain = run(2, 3);
    const auto hooked = run(2, 3, gradsync::AllreduceHook{});
    CHECK(hooked == plain);
    // Overlapped: the hook starts during backward, from grad_ready.
    std::vector<std::vector<std::vector<float>>> overlapped(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        Matrices model(shapes);
        gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{128}},
                                  gradsync::AllreduceHook{});
        for (int s = 0; s < 3; ++s) {
            model.fill(backend.rank(), s);
            for (std::size_t p = 3; p-- > 0;) dp.grad_ready(p);
            dp.synchronize();
        }
        overlapped[static_cast<std::size_t>(backend.rank())] = model.grads();
    });
    CHECK(overlapped[0] == plain[0][2]);
    CHECK(overlapped[1] == plain[1][2]);
}

TEST_CASE("a hook's buckets get the finalize pass once: with a loss scale, step() unscales as without a hook") {
    // step() with a static loss scale, the buckets reduced at step() and overlapped: the
    // gradients after the step and the norm are bitwise those of DataParallel without a hook.
    auto steps = [](bool overlapped, auto... hook) {
        std::vector<std::vector<std::vector<float>>> grads(2);
        std::vector<double> norms(2);
        gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
            const auto r = static_cast<std::size_t>(backend.rank());
            Matrices model(shapes);
            gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{128}},
                                      gradsync::StaticLossScale{.value = 256.0f}, hook...);
            for (int s = 0; s < 2; ++s) {
                model.fill(backend.rank(), s);
                for (auto& t : model.tensors)
                    for (auto& g : t.g) g *= dp.loss_scale();
                if (overlapped)
                    for (std::size_t p = 3; p-- > 0;) dp.grad_ready(p);
                norms[r] = dp.step([] {}).grad_norm;
            }
            grads[r] = model.grads();
        });
        return std::pair(grads, norms);
    };
    for (const bool overlapped : {false, true}) {
        CAPTURE(overlapped);
        const auto plain = steps(overlapped);
        const auto hooked = steps(overlapped, gradsync::AllreduceHook{});
        CHECK(hooked.first == plain.first);
        CHECK(hooked.second == plain.second);
        CHECK(plain.second[0] > 0);
    }
}

// AllreduceHook that notes the dtype and size of every bucket it is handed.
struct DtypeNotingHook {
    using policy_category = gradsync::policy_category::comm_hook;
    static constexpr bool hooked = true;
    std::vector<std::pair<gradsync::DType, std::size_t>>* seen = nullptr;
    [[nodiscard]] std::string settings() const { return "dtype-noting allreduce"; }
    gradsync::HookComm::Pending start(const gradsync::HookBucket& bucket, gradsync::HookComm& comm) {
        seen->emplace_back(bucket.dtype, bucket.values.size());
        return comm.allreduce_async(bucket.values, gradsync::ReduceOp::average);
    }
    void finish(const gradsync::HookBucket&, gradsync::HookComm&) {}
};

TEST_CASE("float16 and bfloat16 buckets reach a hook widened to float32, and its average is rounded once into them") {
    // Three ranks: synchronize() (the rounding without a finalize pass), then step() with a loss
    // scale, overlapped (the widening during backward, the finalize pass unscaling).
    constexpr int world = 3;
    using testing_support::HalfGradients;
    std::vector<std::vector<std::pair<gradsync::DType, std::size_t>>> seen(world);
    std::vector<std::size_t> off(world), off_scaled(world);
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        HalfGradients model;
        gradsync::DataParallel dp(model, backend, DtypeNotingHook{&seen[r]});
        model.fill(backend.rank(), 0);
        dp.synchronize();
        off[r] = model.not_rounded_once(world, 0);
        CHECK(dp.view_buckets() == 1);  // the float32 one; a hook's 16-bit buckets are widened copies

        HalfGradients scaled;
        gradsync::DataParallel scaled_dp(scaled, backend, gradsync::AllreduceHook{},
                                         gradsync::StaticLossScale{.value = 1024.0f});
        scaled.fill(backend.rank(), 1, scaled_dp.loss_scale());
        for (std::size_t p = 4; p-- > 0;) scaled_dp.grad_ready(p);
        const auto report = scaled_dp.step([] {});
        CHECK(report.applied);
        off_scaled[r] = scaled.not_rounded_once(world, 1);
    });
    for (std::size_t r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK(off[r] == 0);
        CHECK(off_scaled[r] == 0);
        // One bucket per dtype, each as float32 values: the two bfloat16 tensors together.
        auto buckets = seen[r];
        std::sort(buckets.begin(), buckets.end());
        CHECK(buckets ==
              std::vector<std::pair<gradsync::DType, std::size_t>>{{gradsync::DType::float32, HalfGradients::n},
                                                                   {gradsync::DType::float16, HalfGradients::n},
                                                                   {gradsync::DType::bfloat16, 2 * HalfGradients::n}});
    }
}

TEST_CASE("PowerSGD at full rank equals the plain average, step after step with error feedback") {
    // Rank min(n, m) and every matrix compressed: P Q^T / world is the average itself (to
    // rounding), and the errors of the ranks sum to zero, so the next step's average is not
    // shifted either.
    const auto plain = run(3, 4);
    const auto full = run(3, 4, gradsync::PowerSGD({.rank = 8, .min_compression_rate = 0}));
    for (std::size_t r = 0; r < 3; ++r)
        for (std::size_t s = 0; s < 4; ++s)
            for (std::size_t k = 0; k < shapes.size(); ++k) {
                CAPTURE(r);
                CAPTURE(s);
                CAPTURE(k);
                CHECK(max_difference(full[r][s][k], plain[r][s][k]) < 2e-6);
                CHECK(full[r][s][k] == full[0][s][k]);  // every rank bitwise alike
            }
}

TEST_CASE("float32_gradient: a 16-bit parameter's average in float32, unscaled and clipped like its gradient") {
    constexpr int world = 3;
    using testing_support::HalfGradients;
    // The float32 copy is the exact average to float32's rounding, and the 16-bit gradient is it
    // rounded; clipping scales both.
    for (const double clip : {0.0, 1.0}) {
        CAPTURE(clip);
        std::vector<std::size_t> off(world), unrounded(world);
        std::vector<std::string> errors(world);
        gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
            const auto r = static_cast<std::size_t>(backend.rank());
            HalfGradients model;
            gradsync::DataParallel dp(model, backend, gradsync::AllreduceHook{},
                                      gradsync::StaticLossScale{.value = 1024.0f},
                                      gradsync::Options{.clip_norm = clip});
            model.fill(backend.rank(), 0, dp.loss_scale());
            const auto report = dp.step([] {});
            CHECK(report.clipped == (clip > 0));
            const double factor = report.clipped ? clip / (report.grad_norm + 1e-6) : 1.0;
            const auto a = dp.float32_gradient("a");
            const auto c = dp.float32_gradient("c");
            REQUIRE(a.size() == HalfGradients::n);
            off[r] = HalfGradients::not_the_average(a, world, 0, 0, factor) +
                     HalfGradients::not_the_average(dp.float32_gradient("b"), world, 0, 1, factor) +
                     HalfGradients::not_the_average(c, world, 0, 2, factor);
            if (clip == 0)
                for (std::size_t i = 0; i < HalfGradients::n; ++i)
                    unrounded[r] +=
                        !(gradsync::bfloat16(a[i]) == model.ga[i]) + !(gradsync::float16(c[i]) == model.gc[i]);
            try {
                (void)dp.float32_gradient("d");
            } catch (const gradsync::Error& e) {
                errors[r] = e.what();
            }
            CHECK_THROWS_WITH_AS((void)dp.float32_gradient("e"), doctest::Contains("no parameter has this name"),
                                 gradsync::Error);
        });
        for (std::size_t r = 0; r < world; ++r) {
            CAPTURE(r);
            CHECK(off[r] == 0);
            CHECK(unrounded[r] == 0);
            CHECK(errors[r] ==
                  "gradsync: float32_gradient(\"d\"): the parameter is float32; only float16 and bfloat16 gradients "
                  "are averaged in a float32 copy");
        }
    }
    // A world of one: the copy is the local gradient, unscaled.
    gradsync::spawn(1, [&](gradsync::LocalBackend& backend) {
        HalfGradients model;
        gradsync::DataParallel dp(model, backend, gradsync::AllreduceHook{}, gradsync::StaticLossScale{.value = 4.0f});
        model.fill(0, 5, dp.loss_scale());
        CHECK(dp.step([] {}).applied);
        CHECK(HalfGradients::not_the_average(dp.float32_gradient("a"), 1, 5, 0) == 0);
        CHECK(HalfGradients::not_the_average(dp.float32_gradient("c"), 1, 5, 2) == 0);
    });
}

TEST_CASE("PowerSGD on bfloat16 matrices: compressed in float32, at full rank their average to a bfloat16 ulp") {
    constexpr int world = 3;
    using testing_support::HalfGradients;
    std::vector<std::size_t> off(world);
    std::vector<char> compressed(world);  // written by every rank's thread: not vector<bool>
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        HalfGradients model;
        gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 7, .min_compression_rate = 0}));
        compressed[r] = dp.comm_hook().state().contains("a") && dp.comm_hook().state().contains("b");
        for (int s = 0; s < 3; ++s) {
            model.fill(backend.rank(), s);
            dp.synchronize();
            off[r] += HalfGradients::off_by_more_than_an_ulp(model.ga, world, s, 0, 8) +
                      HalfGradients::off_by_more_than_an_ulp(model.gb, world, s, 1, 8);
        }
    });
    for (std::size_t r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK(compressed[r]);
        CHECK(off[r] == 0);
    }
}

TEST_CASE("PowerSGD at low rank moves fewer values, keeps the ranks bitwise equal, and carries its error") {
    // The error this rank keeps is what the approximation left out of its gradient plus the
    // error it carried in: gradient + old error == approximation + new error.
    const std::vector<std::vector<std::size_t>> big{{64, 32}, {32}, {32, 16}};
    std::vector<std::vector<float>> result(2);
    std::vector<std::uint64_t> sent(2), reduced(2);
    std::vector<double> identity_error(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        Matrices model(big);
        gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 2}));
        double worst = 0;
        for (int s = 0; s < 3; ++s) {
            model.fill(backend.rank(), s);
            const auto local = model.tensors[0].g;
            const auto carried = dp.comm_hook().state()["m0"].error;  // empty before the first step
            dp.synchronize();
            const auto& kept = dp.comm_hook().state().at("m0").error;
            REQUIRE(kept.size() == local.size());
            for (std::size_t i = 0; i < local.size(); ++i) {
                const double in = double(local[i]) + (carried.empty() ? 0.0 : double(carried[i]));
                worst = std::max(worst, std::abs(in - (double(model.tensors[0].g[i]) + double(kept[i]))));
            }
        }
        identity_error[r] = worst;
        result[r] = model.tensors[0].g;
        sent[r] = dp.comm_hook().elements_sent();
        reduced[r] = dp.comm_hook().elements_reduced();
    });
    CHECK(result[0] == result[1]);
    CHECK(identity_error[0] < 1e-6);
    CHECK(identity_error[1] < 1e-6);
    // Per step: P (64 x 2 + 32 x 2) and Q (32 x 2 + 16 x 2), and the bias exactly: 32.
    CHECK(sent[0] == 3 * (64 * 2 + 32 * 2 + 32 * 2 + 16 * 2 + 32));
    CHECK(reduced[0] == 3 * (64 * 32 + 32 + 32 * 16));
}

TEST_CASE("a step's bytes_reduced with a hook: what the hook's collectives moved, not the bucket's size") {
    const std::vector<std::vector<std::size_t>> big{{64, 32}, {32}, {32, 16}};
    std::vector<std::uint64_t> reported(2), sent(2), plain(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        Matrices model(big);
        gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 2}));
        for (int s = 0; s < 2; ++s) {
            model.fill(backend.rank(), s);
            const auto before = dp.comm_hook().elements_sent();
            reported[r] = dp.step([] {}).bytes_reduced;
            sent[r] = (dp.comm_hook().elements_sent() - before) * sizeof(float);
        }
        Matrices same(big);
        gradsync::DataParallel whole(same, backend, gradsync::AllreduceHook{});
        same.fill(backend.rank(), 0);
        plain[r] = whole.step([] {}).bytes_reduced;
    });
    // P (64 x 2 + 32 x 2), Q (32 x 2 + 16 x 2) and the bias whole (32), in float32.
    CHECK(reported[0] == (64 * 2 + 32 * 2 + 32 * 2 + 16 * 2 + 32) * sizeof(float));
    CHECK(reported[0] == sent[0]);
    CHECK(reported[1] == sent[1]);
    CHECK(plain[0] == (64 * 32 + 32 + 32 * 16) * sizeof(float));
}

TEST_CASE("PowerSGD with overlap on some ranks only: its collectives pair across the ranks, the result as without") {
    // PowerSGD issues collectives in finish() too: a rank that overlaps starts every bucket in
    // backward and finishes them at synchronize(); one that does not must do the same, not start
    // and finish bucket after bucket.
    const auto train = [](bool overlap_rank0) {
        std::vector<std::vector<float>> weights(2);
        gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
            mlp::Mlp model(1);
            gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{4096}},
                                      gradsync::PowerSGD({.rank = 2}));
            if (overlap_rank0 && backend.rank() == 0) model.on_grad_ready = [&](std::size_t i) { dp.grad_ready(i); };
            mlp::Sgd sgd(0.05f, 0.9f);
            for (int s = 0; s < 4; ++s) {
                model.forward_backward(mlp::make_batch(5, static_cast<std::size_t>((2 * s + backend.rank()) * 8), 8));
                (void)dp.step([&] { sgd.step(model); });
            }
            weights[static_cast<std::size_t>(backend.rank())] = model.w1;
        });
        CHECK(weights[0] == weights[1]);
        return weights[0];
    };
    CHECK(train(true) == train(false));
}

TEST_CASE("PowerSGD trains the MLP close to the uncompressed run over the same steps") {
    // 2 ranks, 16 samples each, SGD with momentum, 60 steps: the mean loss of the last 10 steps
    // with rank-4 PowerSGD is within 0.1 of the plain average's (and far below the start).
    auto train = [](auto... policies) {
        std::vector<float> losses(60, 0.0f);
        std::mutex m;
        gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
            mlp::Mlp model(1);
            mlp::Sgd opt(0.05f, 0.9f);
            gradsync::DataParallel dp(model, backend, policies...);
            for (int s = 0; s < 60; ++s) {
                const auto first = static_cast<std::size_t>(s * 32 + backend.rank() * 16);
                const float loss = model.forward_backward(mlp::make_batch(7, first, 16));
                dp.synchronize();
                opt.step(model);
                std::lock_guard lock(m);
                losses[static_cast<std::size_t>(s)] += loss / 2;
            }
        });
        return losses;
    };
    const auto plain = train();
    const auto compressed = train(gradsync::PowerSGD({.rank = 4}));
    auto tail = [](const std::vector<float>& l) {
        double sum = 0;
        for (std::size_t s = 50; s < 60; ++s) sum += l[s];
        return sum / 10;
    };
    MESSAGE("loss: start " << plain[0] << ", plain " << tail(plain) << ", PowerSGD rank 4 " << tail(compressed));
    CHECK(tail(plain) < 0.5 * plain[0]);
    CHECK(std::abs(tail(compressed) - tail(plain)) < 0.1);
}

TEST_CASE("a hook is agreed across the ranks: PowerSGD ranks that differ fail construction on every rank") {
    std::vector<std::string> what(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        Matrices model(shapes);
        try {
            gradsync::DataParallel dp(model, backend,
                                      gradsync::PowerSGD({.rank = static_cast<std::size_t>(1 + backend.rank())}));
        } catch (const gradsync::Error& e) {
            what[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    for (const auto& w : what) {
        CAPTURE(w);
        CHECK(w.find("communication hook is 'PowerSGD rank 1, error feedback on, warm start on, seed 0, min "
                     "compression rate 2' on rank 0 but 'PowerSGD rank 2") != std::string::npos);
    }
}

TEST_CASE("PowerSGD with a loss scaler: an overflow skips the step on every rank and leaves the error as it was") {
    std::vector<int> applied(2);  // not vector<bool>: each rank writes its own element
    std::vector<std::vector<float>> error_before(2), error_after(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        Matrices model(shapes);
        gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 1, .min_compression_rate = 0}),
                                  gradsync::DynamicLossScale{});
        model.fill(backend.rank(), 0);
        for (auto& t : model.tensors)
            for (auto& g : t.g) g *= dp.loss_scale();
        (void)dp.step([] {});
        error_before[r] = dp.comm_hook().state().at("m0").error;
        model.fill(backend.rank(), 1);
        for (auto& t : model.tensors)
            for (auto& g : t.g) g *= dp.loss_scale();
        if (r == 1) model.tensors[0].g[3] = INFINITY;
        applied[r] = dp.step([] {}).applied ? 1 : 0;
        error_after[r] = dp.comm_hook().state().at("m0").error;
    });
    CHECK(applied == std::vector<int>{0, 0});
    CHECK(error_after == error_before);
    CHECK(max_difference(error_before[0], std::vector<float>(error_before[0].size(), 0.0f)) > 0);
}

TEST_CASE("a parameter's shape must hold its elements, and every rank must state the same shapes") {
    SUBCASE("a shape that does not hold the elements is refused") {
        std::vector<float> w(6), g(6);
        struct One {
            std::vector<float>*w, *g;
            std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", *w, *g, {4, 2})}; }
        } model{&w, &g};
        auto ranks = gradsync::LocalBackend::create_group(1);
        CHECK_THROWS_WITH(gradsync::DataParallel(model, ranks[0]),
                          doctest::Contains("parameter 'w' has 6 elements but its shape [4, 2] holds 8"));
    }
    SUBCASE("shapes that differ across ranks are a layout mismatch") {
        std::vector<std::string> what(2);
        gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
            Matrices model(backend.rank() == 0 ? std::vector<std::vector<std::size_t>>{{6, 4}}
                                               : std::vector<std::vector<std::size_t>>{{4, 6}});
            try {
                gradsync::DataParallel dp(model, backend);
            } catch (const gradsync::Error& e) {
                what[static_cast<std::size_t>(backend.rank())] = e.what();
            }
        });
        for (const auto& w : what) {
            CAPTURE(w);
            CHECK(w.find("rank 0 has parameter #0 'm0' (24 x float32, shape [6, 4]) where rank 1 has parameter #0 "
                         "'m0' (24 x float32, shape [4, 6])") != std::string::npos);
        }
    }
}

TEST_CASE("a world of one runs no hook: the local gradient is the average") {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Matrices model(shapes);
    gradsync::DataParallel dp(model, ranks[0], gradsync::PowerSGD({.rank = 1, .min_compression_rate = 0}));
    model.fill(0, 0);
    const auto before = model.grads();
    dp.synchronize();
    CHECK(model.grads() == before);
    CHECK(dp.comm_hook().elements_sent() == 0);
}

TEST_CASE("PowerSGD's state is checkpointed: 6 steps == 3, save, a new group, load, 3 more, bit for bit") {
    // The error feedback differs by rank and goes to each rank's file; Q is the same on every
    // rank and goes into the checkpoint.
    const std::vector<std::vector<std::size_t>> big{{64, 32}, {32}, {32, 16}};
    TempDir dir;
    const auto path = dir.path / "powersgd.safetensors";
    auto train = [&](gradsync::LocalBackend& backend, Matrices& model, auto& dp, int from, int to) {
        for (int s = from; s < to; ++s) {
            model.fill(backend.rank(), s);
            dp.synchronize();
            for (auto& t : model.tensors)
                for (std::size_t i = 0; i < t.w.size(); ++i) t.w[i] -= 0.1f * t.g[i];
        }
    };
    std::vector<std::vector<float>> straight(2), resumed(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        Matrices model(big);
        gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 2}));
        train(backend, model, dp, 0, 6);
        straight[static_cast<std::size_t>(backend.rank())] = model.tensors[0].w;
    });
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        Matrices model(big);
        gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 2}));
        train(backend, model, dp, 0, 3);
        gradsync::Checkpoint().add(dp.comm_hook()).save(path, dp);
    });
    CHECK(std::filesystem::exists(dir.path / "powersgd.safetensors.step-3.rank-0-of-2.safetensors"));
    CHECK(std::filesystem::exists(dir.path / "powersgd.safetensors.step-3.rank-1-of-2.safetensors"));
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        Matrices model(big);
        for (auto& t : model.tensors) std::fill(t.w.begin(), t.w.end(), 0.0f);
        gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 2}));
        gradsync::Checkpoint().add(dp.comm_hook()).load(path, dp);
        CHECK(dp.steps() == 3);
        train(backend, model, dp, 3, 6);
        resumed[static_cast<std::size_t>(backend.rank())] = model.tensors[0].w;
    });
    CHECK(resumed == straight);
    // Without the hook's state, the checkpoint does not load: it holds state nothing here takes.
    std::vector<std::string> what(3);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        Matrices model(big);
        gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 2}));
        try {
            gradsync::Checkpoint().load(path, dp);
        } catch (const gradsync::CheckpointError& e) {
            what[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    CHECK(what[0].find("holds tensor 'powersgd.q.m0', which nothing here loads") != std::string::npos);
    // Nor into another number of ranks: each rank's error is its own.
    gradsync::spawn(3, [&](gradsync::LocalBackend& backend) {
        Matrices model(big);
        gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 2}));
        try {
            gradsync::Checkpoint().add(dp.comm_hook()).load(path, dp);
        } catch (const gradsync::CheckpointError& e) {
            what[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    for (const auto& w : what) {
        CAPTURE(w);
        CHECK(w.find("holds state that differs by rank, saved by 2 ranks; it loads into as many ranks, not 3") !=
              std::string::npos);
    }
}
