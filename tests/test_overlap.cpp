// The overlap engine: grad_ready launches buckets during backward, in plan order whatever the
// arrival order; accumulation under no_sync; unused parameters; bucket rebuild;
// gradients as bucket views; model buffers. Autotuning: test_autotuning.cpp.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/recording_backend.hpp"
#include "support/toy_model.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace gradsync::literals;
using gradsync::DataParallel;
using gradsync::LocalBackend;
using testing_support::expected_average;
using testing_support::RecordingBackend;
using testing_support::Toy;

namespace {

const std::vector<std::size_t> toy_sizes{5, 3000, 1, 40000, 17, 0, 256, 900};

// Random gradients, different per rank and step, not integers: sums round.
void fill_random(Toy& m, int rank, int step) {
    std::mt19937 rng(static_cast<unsigned>(rank * 7919 + step));
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    for (auto& t : m.tensors)
        for (auto& g : t.g) g = d(rng);
    for (auto& t : m.doubles)
        for (auto& g : t.g) g = d(rng);
}

std::vector<std::size_t> shuffled(std::size_t n, unsigned seed) {
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(order.begin(), order.end(), rng);
    return order;
}

std::vector<float> flat_grads(const Toy& m) {
    std::vector<float> out;
    for (const auto& t : m.tensors) out.insert(out.end(), t.g.begin(), t.g.end());
    for (const auto& t : m.doubles)
        for (double g : t.g) out.push_back(static_cast<float>(g));
    return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Gradients after `steps` steps: plain synchronize(), or grad_ready in a random order per rank.
template <class... Policies>
std::vector<std::vector<float>> run_steps(int world, bool overlap, int steps, Policies... policies) {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](LocalBackend& b) {
        Toy m(toy_sizes, 0.0f, 2);
        DataParallel dp(m, b, policies...);
        std::vector<float> all;
        for (int s = 0; s < steps; ++s) {
            fill_random(m, b.rank(), s);
            if (overlap)
                for (auto i : shuffled(m.tensors.size() + m.doubles.size(), static_cast<unsigned>(b.rank() * 31 + s)))
                    dp.grad_ready(i);
            dp.synchronize();
            auto g = flat_grads(m);
            all.insert(all.end(), g.begin(), g.end());
        }
        out[static_cast<std::size_t>(b.rank())] = all;
    });
    return out;
}

template <class... Policies>
void check_overlap_matches_plain(Policies... policies) {
    for (int world = 1; world <= 4; ++world) {
        CAPTURE(world);
        auto plain = run_steps(world, false, 3, policies...);
        auto overlapped = run_steps(world, true, 3, policies...);
        for (int r = 0; r < world; ++r) {
            CHECK(same_bits(overlapped[static_cast<std::size_t>(r)], plain[static_cast<std::size_t>(r)]));
            CHECK(same_bits(overlapped[static_cast<std::size_t>(r)], overlapped[0]));
        }
    }
}

}  // namespace

TEST_CASE("overlapped steps give bitwise the gradients of plain synchronize(), arrival orders differing per rank") {
    check_overlap_matches_plain();
    check_overlap_matches_plain(gradsync::SizeCappedBuckets{16_KiB, 1_KiB});
    check_overlap_matches_plain(gradsync::SingleBucket{});
    check_overlap_matches_plain(gradsync::PerParameterBuckets{});
    check_overlap_matches_plain(gradsync::PackedBuckets{}, gradsync::SizeCappedBuckets{16_KiB, 1_KiB});
}

TEST_CASE("grad_ready may come from several threads of a rank at once") {
    auto plain = run_steps(3, false, 2);
    std::vector<std::vector<float>> got(3);
    gradsync::spawn(3, [&](LocalBackend& b) {
        Toy m(toy_sizes, 0.0f, 2);
        DataParallel dp(m, b, gradsync::PerParameterBuckets{});
        std::vector<float> all;
        for (int s = 0; s < 2; ++s) {
            fill_random(m, b.rank(), s);
            auto order = shuffled(m.parameter_count(), static_cast<unsigned>(b.rank() + 100 * s));
            std::thread helper([&] {
                for (std::size_t k = 0; k < order.size(); k += 2) dp.grad_ready(order[k]);
            });
            for (std::size_t k = 1; k < order.size(); k += 2) dp.grad_ready(order[k]);
            helper.join();
            dp.synchronize();
            auto g = flat_grads(m);
            all.insert(all.end(), g.begin(), g.end());
        }
        got[static_cast<std::size_t>(b.rank())] = all;
    });
    for (int r = 0; r < 3; ++r) CHECK(same_bits(got[static_cast<std::size_t>(r)], plain[static_cast<std::size_t>(r)]));
}

TEST_CASE("buckets launch in plan order, whatever order their gradients arrive in") {
    std::vector<std::vector<testing_support::Collective>> logs(2);
    std::vector<std::size_t> launched_during_backward(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        RecordingBackend rec(b);
        Toy m({1000, 1000, 1000, 1000, 1000, 1000}, 0.0f);
        DataParallel dp(m, rec, gradsync::PerParameterBuckets{});  // plan: t5, t4, ..., t0
        rec.log.clear();
        for (std::size_t k = 0; k < 6; ++k) std::fill(m.tensors[k].g.begin(), m.tensors[k].g.end(), float(k));
        // Rank 0: t0 first, so nothing can launch until t5 arrives last. Rank 1: t5, t3, t4, ...
        std::vector<std::size_t> order =
            b.rank() == 0 ? std::vector<std::size_t>{0, 1, 2, 3, 4, 5} : std::vector<std::size_t>{5, 3, 4, 0, 2, 1};
        for (auto i : order) dp.grad_ready(i);
        launched_during_backward[static_cast<std::size_t>(b.rank())] = rec.log.size();
        dp.synchronize();
        logs[static_cast<std::size_t>(b.rank())] = rec.log;
    });
    CHECK(launched_during_backward[0] == 6);  // all launched by the last grad_ready
    for (const auto& log : logs) {
        REQUIRE(log.size() == 7);  // six buckets and the history check
        for (std::size_t k = 0; k < 6; ++k) CHECK(log[k].first == float(5 - k));
    }
}

TEST_CASE("misused grad_ready is an error on the caller and on its peers") {
    SUBCASE("twice for one parameter") {
        std::vector<std::string> messages(2);
        gradsync::spawn(2, [&](LocalBackend& b) {
            Toy m({10, 20}, 0.0f);
            DataParallel dp(m, b, gradsync::Options{.timeout = std::chrono::seconds(20)});
            try {
                dp.grad_ready(std::size_t{0});
                if (b.rank() == 1) dp.grad_ready("t0");
                dp.grad_ready(std::size_t{1});
                dp.synchronize();
            } catch (const gradsync::Error& e) {
                messages[static_cast<std::size_t>(b.rank())] = e.what();
            }
        });
        for (const auto& m : messages)
            CHECK(m.find("rank 1, step 1: grad_ready for parameter 't0' was called twice in one step") !=
                  std::string::npos);
    }
    SUBCASE("bad index or name") {
        auto ranks = LocalBackend::create_group(1);
        Toy m({10, 0, 20}, 0.0f);
        m.tensors[2].name = "t0";  // two parameters called t0
        DataParallel dp(m, ranks[0]);
        dp.grad_ready(std::size_t{1});  // zero-sized: nothing to do
        CHECK_THROWS_WITH_AS(dp.grad_ready(std::size_t{3}),
                             doctest::Contains("grad_ready(3) but the model has 3 parameters"),
                             gradsync::ReadinessError);
        CHECK_THROWS_WITH_AS(dp.grad_ready("nope"), doctest::Contains("no parameter has this name"),
                             gradsync::ReadinessError);
        CHECK_THROWS_WITH_AS(dp.grad_ready("t0"), doctest::Contains("several parameters have this name"),
                             gradsync::ReadinessError);
    }
}

TEST_CASE("a parameter without grad_ready is an error naming it and the step, on every rank") {
    std::vector<std::string> messages(3);
    gradsync::spawn(3, [&](LocalBackend& b) {
        Toy m({100, 200, 300, 400}, 0.0f);
        DataParallel dp(m, b, gradsync::PerParameterBuckets{}, gradsync::Options{.timeout = std::chrono::seconds(20)});
        try {
            for (std::size_t i = 0; i < 4; ++i)
                if (!(b.rank() == 2 && i == 1)) dp.grad_ready(i);
            dp.synchronize();
        } catch (const gradsync::Error& e) {
            messages[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& m : messages) {
        CAPTURE(m);
        CHECK(m.find("rank 2, step 1: synchronize() found no grad_ready for 1 parameter: 't1' (bucket 2)") !=
              std::string::npos);
    }
}

TEST_CASE("unused parameters count as zero, consistently on every rank") {
    for (int world : {1, 2, 3}) {
        std::vector<std::vector<float>> t1(static_cast<std::size_t>(world)), t2(static_cast<std::size_t>(world));
        gradsync::spawn(world, [&](LocalBackend& b) {
            Toy m({50, 60, 70}, 0.0f);
            DataParallel dp(m, b, gradsync::Options{.find_unused_parameters = true});
            for (int step = 0; step < 2; ++step) {
                m.fill_grads(b.rank());
                std::fill(m.tensors[2].g.begin(), m.tensors[2].g.end(), 99.0f);  // stale: t2 is unused everywhere
                dp.grad_ready(std::size_t{0});
                if (b.rank() == 0)
                    dp.grad_ready(std::size_t{1});  // t1 is used on rank 0 only
                else
                    std::fill(m.tensors[1].g.begin(), m.tensors[1].g.end(), 42.0f);
                dp.synchronize();
            }
            t1[static_cast<std::size_t>(b.rank())] = m.tensors[1].g;
            t2[static_cast<std::size_t>(b.rank())] = m.tensors[2].g;
        });
        for (int r = 0; r < world; ++r) {
            CAPTURE(r);
            for (std::size_t i = 0; i < 60; ++i) {
                float want = world == 1 ? Toy::grad_value(0, 1, i)
                                        : Toy::grad_value(0, 1, i) * (1.0f / static_cast<float>(world));
                CHECK(t1[static_cast<std::size_t>(r)][i] == want);
            }
            for (float g : t2[static_cast<std::size_t>(r)]) CHECK(g == 0.0f);
        }
    }
}

TEST_CASE("no_sync accumulates locally and the next synchronized step reduces the sum") {
    const int k = 3;
    std::vector<std::vector<testing_support::Collective>> logs(2);
    std::vector<std::vector<float>> grads(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        RecordingBackend rec(b);
        Toy m({100, 2000, 30}, 0.0f);
        DataParallel dp(m, rec);
        rec.log.clear();
        for (auto& t : m.tensors) std::fill(t.g.begin(), t.g.end(), 0.0f);
        for (int micro = 0; micro < k; ++micro) {
            auto add = [&] {
                for (std::size_t t = 0; t < 3; ++t)
                    for (std::size_t i = 0; i < m.tensors[t].g.size(); ++i)
                        m.tensors[t].g[i] += Toy::grad_value(b.rank(), t, i);
            };
            if (micro < k - 1) {
                auto guard = dp.no_sync();
                add();
                // t0 is used only in the micro-steps: its accumulated sum is final at synchronize().
                for (std::size_t t = 0; t < 3; ++t) dp.grad_ready(t);
                dp.synchronize();  // communicates nothing
            } else {
                for (std::size_t t = 0; t < 3; ++t)
                    for (std::size_t i = 0; i < m.tensors[t].g.size(); ++i)
                        if (t != 0) m.tensors[t].g[i] += Toy::grad_value(b.rank(), t, i);
                CHECK(rec.log.empty());
                dp.grad_ready(std::size_t{2});
                dp.grad_ready(std::size_t{1});
                dp.synchronize();
            }
        }
        CHECK(dp.steps() == 1);
        logs[static_cast<std::size_t>(b.rank())] = rec.log;
        grads[static_cast<std::size_t>(b.rank())] = flat_grads(m);
    });
    // t0 got k-1 contributions, t1 and t2 k.
    std::vector<float> want;
    for (std::size_t t = 0; t < 3; ++t) {
        const std::size_t n = std::vector<std::size_t>{100, 2000, 30}[t];
        const float contributions = t == 0 ? float(k - 1) : float(k);
        for (std::size_t i = 0; i < n; ++i)
            want.push_back((contributions * Toy::grad_value(0, t, i) + contributions * Toy::grad_value(1, t, i)) *
                           0.5f);
    }
    for (const auto& g : grads) CHECK(same_bits(g, want));
}

TEST_CASE("accumulation equivalence: k micro-batches under no_sync == one step on the k times larger batch") {
    constexpr int k = 3, micro_batch = 4, steps = 5;
    for (int world : {1, 2, 3}) {
        CAPTURE(world);
        // One process, batch world * k * micro_batch.
        mlp::Mlp single(1);
        mlp::Sgd single_opt(0.05f, 0.9f);
        const int global = world * k * micro_batch;
        for (int s = 0; s < steps; ++s) {
            single.forward_backward(mlp::make_batch(11, static_cast<std::size_t>(s * global), global));
            single_opt.step(single);
        }
        std::vector<std::vector<float>> w1(static_cast<std::size_t>(world));
        gradsync::spawn(world, [&](LocalBackend& b) {
            mlp::Mlp model(1);
            DataParallel dp(model, b);
            model.on_grad_ready = [&dp](std::size_t i) { dp.grad_ready(i); };
            mlp::Sgd opt(0.05f, 0.9f);
            for (int s = 0; s < steps; ++s) {
                for (int micro = 0; micro < k; ++micro) {
                    auto first = static_cast<std::size_t>(s * global + (micro * world + b.rank()) * micro_batch);
                    auto batch = mlp::make_batch(11, first, micro_batch);
                    if (micro < k - 1) {
                        auto guard = dp.no_sync();
                        model.forward_backward(batch, 1.0f / k, /*accumulate=*/micro > 0);
                    } else {
                        model.forward_backward(batch, 1.0f / k, /*accumulate=*/true);
                        dp.synchronize();
                    }
                }
                opt.step(model);
            }
            w1[static_cast<std::size_t>(b.rank())] = model.w1;
        });
        double diff = 0, norm = 0;
        for (std::size_t i = 0; i < single.w1.size(); ++i) {
            double d = double(w1[0][i]) - double(single.w1[i]);
            diff += d * d;
            norm += double(single.w1[i]) * double(single.w1[i]);
        }
        CHECK(std::sqrt(diff / norm) <= 1e-5);
        for (const auto& w : w1) CHECK(same_bits(w, w1[0]));
    }
}

TEST_CASE("no_sync after grad_ready in the same step is refused") {
    auto ranks = LocalBackend::create_group(1);
    Toy m({10, 20}, 0.0f);
    DataParallel dp(m, ranks[0]);
    dp.grad_ready(std::size_t{0});
    CHECK_THROWS_WITH_AS((void)dp.no_sync(), doctest::Contains("no_sync() after grad_ready() calls of the same step"),
                         gradsync::ReadinessError);
}

TEST_CASE("no_sync after grad_ready on one rank fails the peer's step too, though its buckets completed") {
    // Rank 0's hooks launched every bucket before it entered no_sync(): the peer's collectives
    // complete, and only the group's abort tells it that rank 0 left the step.
    std::atomic<bool> refused{false};
    std::atomic<int> peer_steps{0};
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy m({10, 20}, 0.0f);
        DataParallel dp(m, b);
        m.fill_grads(b.rank());
        dp.grad_ready(std::size_t{0});
        dp.grad_ready(std::size_t{1});
        if (b.rank() == 0) {
            CHECK_THROWS_WITH_AS((void)dp.no_sync(), doctest::Contains("rank 0, step 1: no_sync() after grad_ready()"),
                                 gradsync::ReadinessError);
            refused = true;
        } else {
            while (!refused) std::this_thread::yield();
            CHECK_THROWS_WITH_AS(
                dp.synchronize(),
                doctest::Contains("rank 1: the group was aborted: gradsync: rank 0, step 1: no_sync()"),
                gradsync::CollectiveError);
            peer_steps = static_cast<int>(dp.steps());
        }
    });
    CHECK(peer_steps == 0);
}

TEST_CASE("step() under no_sync on one rank fails the peer at once, not at its deadline") {
    const auto began = std::chrono::steady_clock::now();
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy m({10, 20}, 0.0f);
        DataParallel dp(m, b, gradsync::Options{.timeout = std::chrono::seconds(60)});
        m.fill_grads(b.rank());
        if (b.rank() == 0) {
            auto guard = dp.no_sync();
            CHECK_THROWS_WITH_AS((void)dp.step([] {}), doctest::Contains("step() under no_sync()"),
                                 gradsync::ReadinessError);
        } else {
            CHECK_THROWS_WITH_AS((void)dp.step([] {}), doctest::Contains("the group was aborted: gradsync: rank 0"),
                                 gradsync::CollectiveError);
        }
    });
    CHECK(std::chrono::steady_clock::now() - began < std::chrono::seconds(30));
}

TEST_CASE("bucket rebuild: after the first step, buckets follow rank 0's readiness order on every rank") {
    const gradsync::SizeCappedBuckets policy{8_KiB, 2_KiB};
    std::vector<gradsync::BucketPlan> before(2), after(2);
    std::vector<std::vector<float>> grads(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy m({500, 500, 500, 500, 500, 500, 500, 500}, 0.0f);
        DataParallel dp(m, b, policy, gradsync::Options{.rebuild_buckets = true});
        before[static_cast<std::size_t>(b.rank())] = dp.plan();
        for (int s = 0; s < 2; ++s) {
            m.fill_grads(b.rank());
            // Rank 0 sees registration order; rank 1 something else. Rank 0's wins.
            auto order = b.rank() == 0 ? std::vector<std::size_t>{0, 1, 2, 3, 4, 5, 6, 7}
                                       : shuffled(8, static_cast<unsigned>(s + 5));
            for (auto i : order) dp.grad_ready(i);
            dp.synchronize();
            if (s == 0) after[static_cast<std::size_t>(b.rank())] = dp.plan();
        }
        grads[static_cast<std::size_t>(b.rank())] = flat_grads(m);
    });
    std::vector<gradsync::Parameter> layout;
    for (int k = 0; k < 8; ++k) layout.push_back({"t", nullptr, nullptr, 500, gradsync::DType::float32});
    const std::size_t registration[] = {0, 1, 2, 3, 4, 5, 6, 7};
    CHECK(before[0] == policy.plan(layout));
    CHECK(after[0] == policy.plan(layout, registration));
    CHECK(after[1] == after[0]);
    CHECK_FALSE(after[0] == before[0]);
    CHECK(after[0].buckets.front().parameters.front() == 0);
    for (const auto& g : grads) {
        std::size_t at = 0;
        for (std::size_t t = 0; t < 8; ++t)
            for (std::size_t i = 0; i < 500; ++i) CHECK(g[at++] == expected_average<float>(2, t, i));
    }
}

TEST_CASE("gradients in one blob are bucket views: no pack, no unpack, no bucket buffer") {
    const std::size_t sizes[] = {1000, 3, 20000, 7, 5000};
    std::vector<std::vector<float>> results(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        std::vector<float> params(26010, 0.0f), grads(26010);
        gradsync::ContiguousParameters<float> blob(params.data(), grads.data(), sizes);
        RecordingBackend rec(b);  // contiguous-only: without views it would pack
        DataParallel dp(blob, rec, gradsync::SizeCappedBuckets{40_KiB, 8_KiB});
        CHECK(dp.view_buckets() == dp.plan().buckets.size());
        CHECK(dp.extra_memory() < 1_KiB);
        for (std::size_t i = 0; i < grads.size(); ++i) grads[i] = float(b.rank() + 1) * float(i % 11);
        dp.synchronize();
        results[static_cast<std::size_t>(b.rank())] = grads;
    });
    for (const auto& g : results)
        for (std::size_t i = 0; i < g.size(); ++i) CHECK(g[i] == 1.5f * float(i % 11));
}

TEST_CASE("buffer policies: broadcast every step, once, average, or leave alone") {
    auto run = [](auto policy) {
        std::vector<std::vector<float>> means(2);
        std::vector<std::int64_t> counters(2);
        gradsync::spawn(2, [&](LocalBackend& b) {
            Toy m({10}, 0.0f);
            m.running_mean.assign(4, float(b.rank() + 1));  // 1 on rank 0, 2 on rank 1
            m.counters.assign(1, 10 + b.rank());
            DataParallel dp(m, b, policy);
            m.running_mean.assign(4, float(b.rank() + 1) * 10.0f);  // this step's forward: 10 and 20
            m.counters[0] += 1;
            dp.synchronize();
            means[static_cast<std::size_t>(b.rank())] = m.running_mean;
            counters[static_cast<std::size_t>(b.rank())] = m.counters[0];
        });
        return std::pair(means, counters);
    };
    auto [every, every_counts] = run(gradsync::BroadcastBuffers{});
    CHECK(every[0][0] == 10.0f);
    CHECK(every[1][0] == 10.0f);
    CHECK(every_counts[1] == 11);
    auto [once, once_counts] = run(gradsync::BroadcastBuffersOnce{});
    CHECK(once[0][0] == 10.0f);
    CHECK(once[1][0] == 20.0f);  // equal at construction, free afterwards
    CHECK(once_counts[1] == 11);
    auto [avg, avg_counts] = run(gradsync::AverageBuffers{});
    CHECK(avg[0][3] == 15.0f);
    CHECK(avg[1][3] == 15.0f);
    CHECK(avg_counts[1] == 11);  // integers cannot be averaged: copied from rank 0
    auto [alone, alone_counts] = run(gradsync::IgnoreBuffers{});
    CHECK(alone[0][0] == 10.0f);
    CHECK(alone[1][0] == 20.0f);
    CHECK(alone_counts[1] == 12);  // never touched, not even at construction
}

TEST_CASE("buffers join the layout agreement") {
    std::vector<std::string> messages(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy m({10}, 0.0f);
        m.running_mean.assign(b.rank() == 0 ? 4 : 5, 0.0f);
        try {
            DataParallel dp(m, b);
        } catch (const gradsync::LayoutMismatch& e) {
            messages[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& m : messages)
        CHECK(m.find("rank 0 has buffer #0 'bn.running_mean' (4 x float32) where rank 1 has buffer #0 "
                     "'bn.running_mean' (5 x float32)") != std::string::npos);
}
