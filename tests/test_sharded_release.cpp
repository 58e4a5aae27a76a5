// ShardedDataParallel with released gradients (stage 2): each bucket's share of this rank is kept
// by the wrapper once reduced and the model frees the bucket's gradients; training ends bitwise
// where stage 1 ends, overlapped or not, with a loss scale, clipping, accumulation and an unused
// parameter; gradients that move between steps are followed in stage 1 too; what cannot work is
// refused on every rank alike.
#include <gradsync/backend/local.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/sharded_optimizers.hpp"
#include "support/sharded_training.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

using namespace gradsync::literals;
using sharded::batch_of;
using sharded::bitwise_equal;
using sharded::ReleasingMlp;
using sharded::ShardedAdam;
using sharded::ShardedSgd;
using sharded::steps;
using sharded::train_sharded;
using sharded::Weights;
using sharded::weights_of;

namespace {

const gradsync::ShardedOptions stage2{.release_gradients = true};
const gradsync::SizeCappedBuckets small_caps{.cap = 64_KiB, .first_cap = 4_KiB};
const gradsync::SizeCappedBuckets tiny_caps{.cap = 1_KiB, .first_cap = 1_KiB};  // a bucket per parameter

// The elements of the packed gradient buffers lent in turn to the buckets of `plan`: bucket b
// borrows buffer b % 3, as large as the largest bucket it serves.
std::size_t lent_elements(const gradsync::BucketPlan& plan) {
    std::size_t largest[3] = {0, 0, 0};
    for (std::size_t b = 0; b < plan.buckets.size(); ++b)
        largest[b % 3] = std::max(largest[b % 3], plan.buckets[b].count);
    return largest[0] + largest[1] + largest[2];
}

}  // namespace

TEST_CASE("released gradients == stage 1 bitwise, N = 1..4, two plans, overlapped on all, some or no ranks") {
    for (int world = 1; world <= 4; ++world) {
        CAPTURE(world);
        for (const auto& caps : {gradsync::SizeCappedBuckets{}, small_caps}) {
            CAPTURE(caps.settings());
            const auto stage1 = train_sharded<false>(world, caps);
            CHECK(bitwise_equal(train_sharded<false, ReleasingMlp>(world, caps, stage2), stage1));
            CHECK(bitwise_equal(train_sharded<false, ReleasingMlp>(world, caps, stage2, world), stage1));
            if (world > 1) CHECK(bitwise_equal(train_sharded<false, ReleasingMlp>(world, caps, stage2, 1), stage1));
            CHECK(bitwise_equal(train_sharded<true, ReleasingMlp>(world, caps, stage2, world),
                                train_sharded<true>(world, caps)));
        }
    }
}

TEST_CASE("released gradients over a backend that reduces packed copies == stage 1 bitwise, N = 1..3, overlapped") {
    for (int world = 1; world <= 3; ++world) {
        CAPTURE(world);
        for (const auto& caps : {small_caps, tiny_caps}) {  // 3 and 4 buckets: a buffer serves two
            CAPTURE(caps.settings());
            const auto stage1 = train_sharded<false>(world, caps);
            for (int overlapping : {0, world}) {
                CAPTURE(overlapping);
                CHECK(bitwise_equal(
                    sharded::train_sharded_over<false, ReleasingMlp, true>(world, caps, stage2, overlapping), stage1));
            }
        }
    }
}

TEST_CASE("released gradients over packed copies: three gradient buffers lent in turn instead of one per bucket") {
    gradsync::spawn(3, [&](gradsync::LocalBackend& local) {
        sharded::BufferOnly backend{local};
        ReleasingMlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend, tiny_caps, stage2);
        model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(i); };
        REQUIRE(sdp.plan().buckets.size() > 3);  // more buckets than buffers
        const std::size_t lent = lent_elements(sdp.plan());
        CHECK(lent < sdp.parameter_elements());
        // The parameters' packed copies (one per bucket), this rank's share, the three lent
        // gradient buffers, and a little bookkeeping.
        const gradsync::Bytes held{(sdp.parameter_elements() + sdp.state_elements() + lent) * sizeof(float)};
        CHECK(sdp.extra_memory() >= held);
        CHECK(sdp.extra_memory() < held + 1_KiB);
        ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        for (int s = 0; s < 3; ++s) {
            model.forward_backward(batch_of(3, backend.rank(), s));
            CHECK(sdp.step(sgd).applied);
            CHECK(model.gradient_bytes() == 0);
        }
    });
    // Stage 1 keeps a gradient buffer per bucket.
    gradsync::spawn(2, [&](gradsync::LocalBackend& local) {
        sharded::BufferOnly backend{local};
        mlp::Mlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend, tiny_caps);
        CHECK(sdp.extra_memory() >= gradsync::Bytes{2 * sdp.parameter_elements() * sizeof(float)});
    });
}

TEST_CASE("released gradients: the model holds none after a step, the wrapper this rank's share") {
    gradsync::spawn(3, [&](gradsync::LocalBackend& backend) {
        ReleasingMlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend, small_caps, stage2);
        model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(i); };
        const std::size_t all = sdp.parameter_elements() * sizeof(float);
        const gradsync::Bytes share{sdp.state_elements() * sizeof(float)};  // and a little bookkeeping
        CHECK(sdp.extra_memory() >= share);
        CHECK(sdp.extra_memory() < share + 1_KiB);
        ShardedAdam adam;
        adam.m1.assign(sdp.state_elements(), 0.0f);
        adam.m2.assign(sdp.state_elements(), 0.0f);
        for (int s = 0; s < 3; ++s) {
            model.forward_backward(batch_of(3, backend.rank(), s));
            CHECK(model.gradient_bytes() <= all);
            std::size_t seen = 0;
            const auto report = sdp.step([&](sharded::Pieces pieces) {
                // The averaged gradients the optimizer reads are the wrapper's, not the model's.
                for (const auto& p : pieces) seen += p.grads.size();
                adam(pieces);
            });
            CHECK(report.applied);
            CHECK(seen == sdp.state_elements());
            CHECK(model.gradient_bytes() == 0);
            CHECK(model.releases == 4 * static_cast<std::size_t>(s + 1));  // every parameter, once a step
        }
    });
}

namespace {

// A dynamic loss scale that grows every 3 steps, an overflow on the last rank at step 4, clipping
// and two accumulated half batches per step; stage 1 on the plain MLP or stage 2 on ReleasingMlp.
template <class Model>
std::vector<Weights> train_mixed(int world, gradsync::ShardedOptions options, std::vector<float>& scales) {
    std::vector<Weights> out(static_cast<std::size_t>(world));
    const gradsync::DynamicLossScale scaler{.init_scale = 1024.0f, .growth_interval = 3};
    options.clip_norm = 0.05;
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        Model model(/*seed=*/1);
        gradsync::ShardedDataParallel sdp(model, backend, small_caps, options, scaler);
        ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        for (int s = 0; s < steps; ++s) {
            const auto batch = batch_of(world, backend.rank(), s);
            mlp::Batch first = batch, second = batch;  // the same batch, half the loss each
            model.on_grad_ready = nullptr;
            model.forward_backward(first, 0.5f * sdp.loss_scale());
            model.on_grad_ready = [&](std::size_t i) {
                // The overflow enters before its bucket goes (during backward).
                if (i == 3 && s == 4 && backend.rank() == world - 1)
                    model.gb2[0] = std::numeric_limits<float>::infinity();
                sdp.grad_ready(i);
            };
            model.forward_backward(second, 0.5f * sdp.loss_scale(), /*accumulate=*/true);
            const auto report = sdp.step(sgd);
            CHECK(report.applied == (s != 4));
            if (backend.rank() == 0) scales.push_back(report.loss_scale);
        }
        out[static_cast<std::size_t>(backend.rank())] = weights_of(model);
    });
    return out;
}

}  // namespace

TEST_CASE("released gradients with a loss scale, an overflow, clipping and accumulation == stage 1 bitwise") {
    for (int world : {1, 2, 3}) {
        CAPTURE(world);
        std::vector<float> scales1, scales2;
        const auto stage1 = train_mixed<mlp::Mlp>(world, {}, scales1);
        const auto released = train_mixed<ReleasingMlp>(world, stage2, scales2);
        for (const auto& w : released) CHECK(bitwise_equal(w, stage1[0]));
        CHECK(scales1 == scales2);
        CHECK(scales2[5] == scales2[4] / 2);  // the overflow backed the scale off
    }
}

namespace {

// ReleasingMlp with a parameter its forward never uses: no gradient from backward, no grad_ready.
// Listed last, it lies in the plan's first bucket (plans go from the last parameter), which then
// waits for step() with every bucket after it; listed first, in the last bucket, so that the
// others are reduced and released during backward and step() lists the model again.
struct WithUnused : ReleasingMlp {
    WithUnused(std::uint64_t seed, bool spare_first) : ReleasingMlp(seed), first(spare_first) {}
    bool first;
    std::vector<float> spare = std::vector<float>(37, 0.5f), spare_grad;
    std::size_t spare_index() const { return first ? 0 : 4; }
    std::vector<gradsync::Parameter> parameters() {
        if (spare_grad.empty()) spare_grad.assign(spare.size(), 0.0f);
        return with_spare(ReleasingMlp::parameters(), spare_grad.data());
    }
    std::vector<gradsync::Parameter> parameters_now() {
        return with_spare(ReleasingMlp::parameters_now(), spare_grad.empty() ? nullptr : spare_grad.data());
    }
    void release_gradients(std::span<const std::size_t> indices) {
        std::vector<std::size_t> mine;
        for (auto i : indices) {
            if (i == spare_index()) {
                spare_grad.clear();
                spare_grad.shrink_to_fit();
            } else {
                mine.push_back(first ? i - 1 : i);
            }
        }
        ReleasingMlp::release_gradients(mine);
    }

private:
    std::vector<gradsync::Parameter> with_spare(std::vector<gradsync::Parameter> out, float* grad) {
        out.insert(out.begin() + static_cast<std::ptrdiff_t>(spare_index()),
                   gradsync::parameter("spare", spare.data(), grad, spare.size()));
        return out;
    }
};

}  // namespace

TEST_CASE("an unused parameter, gradients kept or released: its zeros reduced at step(), the rest unchanged") {
    for (bool release : {false, true}) {
        for (bool spare_first : {false, true}) {
            for (int world : {2, 3}) {
                CAPTURE(release);
                CAPTURE(spare_first);
                CAPTURE(world);
                const auto plain = train_sharded<false>(world, small_caps, {}, world);
                std::vector<float> spare;
                Weights weights;
                gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
                    WithUnused model(1, spare_first);
                    gradsync::ShardedDataParallel sdp(model, backend, small_caps,
                                                      gradsync::ShardedOptions{.release_gradients = release});
                    model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(spare_first ? i + 1 : i); };
                    ShardedSgd sgd;
                    sgd.velocity.assign(sdp.state_elements(), 0.0f);
                    for (int s = 0; s < steps; ++s) {
                        model.forward_backward(batch_of(world, backend.rank(), s));
                        // Listed first, only the spare's bucket waits for step().
                        CHECK(sdp.buckets_launched() == (spare_first ? sdp.plan().buckets.size() - 1 : 0));
                        CHECK(sdp.step(sgd).applied);
                        // Released: nothing is left made, not the spare's zeros, not what step()'s
                        // listing made again.
                        if (release) CHECK(model.spare_grad.empty());
                        if (release) CHECK(model.gradient_bytes() == 0);
                    }
                    if (backend.rank() == 0) {
                        spare = model.spare;
                        weights = weights_of(model);
                    }
                });
                CHECK(spare == std::vector<float>(37, 0.5f));
                CHECK(bitwise_equal(weights, plain));
            }
        }
    }
}

TEST_CASE("stage 1 follows gradients that move between steps (freed by the trainer, made in backward)") {
    // Clipped every step: the norm and the clipping must reach the gradients where they lie now.
    const gradsync::ShardedOptions clipped{.clip_norm = 1e-3};
    for (int world : {1, 3}) {
        CAPTURE(world);
        Weights moved;
        gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
            ReleasingMlp model(1);
            gradsync::ShardedDataParallel sdp(model, backend, small_caps, clipped);
            if (backend.rank() == 0) model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(i); };
            ShardedSgd sgd;
            sgd.velocity.assign(sdp.state_elements(), 0.0f);
            const std::size_t all[] = {0, 1, 2, 3};
            for (int s = 0; s < steps; ++s) {
                // Something kept alive so that the next gradients cannot reuse the freed memory.
                std::vector<float> hold(2048, float(s));
                model.forward_backward(batch_of(world, backend.rank(), s));
                const auto report = sdp.step(sgd);
                CHECK(report.applied);
                CHECK(report.clipped);
                model.release_gradients(all);  // as zero_grad(set_to_none) would
            }
            if (backend.rank() == 0) moved = weights_of(model);
        });
        CHECK(bitwise_equal(moved, train_sharded<false>(world, small_caps, clipped)));
    }
}

TEST_CASE("released gradients are refused without a model that releases them, or with a rank that does not ask") {
    std::vector<std::string> messages(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);  // has no release_gradients
        try {
            gradsync::ShardedDataParallel sdp(model, backend, stage2);
        } catch (const gradsync::ConfigurationError& e) {
            messages[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    for (const auto& m : messages) {
        CAPTURE(m);
        CHECK(m.find("release_gradients needs a model that can release gradients") != std::string::npos);
    }
    // A rank that asks for it while another does not: the settings differ, every rank refuses.
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        ReleasingMlp model(1);
        CHECK_THROWS_AS(gradsync::ShardedDataParallel(
                            model, backend, gradsync::ShardedOptions{.release_gradients = backend.rank() == 1}),
                        gradsync::ConfigurationError);
    });
}
