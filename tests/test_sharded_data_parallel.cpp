// ShardedDataParallel: the example MLP trained on N ranks with the optimizer's state split across
// them ends bitwise where DataParallel's unsharded training ends (LocalBackend's reduce_scatter
// gives the allreduce's bits, and the optimizers are elementwise), and within 1e-5 of one process
// on the whole batch; each rank keeps 1/N of the state; clipping, non-finite gradients and bad
// settings behave alike on every rank.
#include <gradsync/backend/local.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/sharded_optimizers.hpp"
#include "support/sharded_training.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

using namespace gradsync::literals;
using sharded::Pieces;
using sharded::ShardedAdam;
using sharded::ShardedSgd;

namespace {

using sharded::batch_of;
using sharded::bitwise_equal;
using sharded::check_close;
using sharded::data_seed;
using sharded::micro_batch;
using sharded::steps;
using sharded::train_sharded;
using sharded::train_single;
using sharded::train_unsharded;
using sharded::Weights;
using sharded::weights_of;

template <bool Adam>
void check_equivalence() {
    const gradsync::SizeCappedBuckets caps[] = {gradsync::SizeCappedBuckets{},
                                                gradsync::SizeCappedBuckets{.cap = 64_KiB, .first_cap = 4_KiB}};
    for (int world = 1; world <= 4; ++world) {
        CAPTURE(world);
        const auto single = train_single<Adam>(world);
        for (const auto& c : caps) {
            CAPTURE(c.settings());
            const auto sharded = train_sharded<Adam>(world, c);
            CHECK(bitwise_equal(sharded, train_unsharded<Adam>(world, c)));
            check_close(sharded, single, 1e-5);
            // Overlapped with backward on every rank, or on some: the same bits.
            if constexpr (!Adam) {
                CHECK(bitwise_equal(train_sharded<Adam>(world, c, {}, world), sharded));
                if (world > 1) CHECK(bitwise_equal(train_sharded<Adam>(world, c, {}, 1), sharded));
            }
        }
    }
}

}  // namespace

TEST_CASE("sharded == unsharded bitwise == one process on the whole batch, N = 1..4 (SGD with momentum)") {
    check_equivalence<false>();
}

TEST_CASE("sharded == unsharded bitwise == one process on the whole batch, N = 1..4 (Adam)") {
    check_equivalence<true>();
}

TEST_CASE("sharded clipping: the global norm agreed by one allreduce, as DataParallel clips") {
    for (int world : {2, 3}) {
        CAPTURE(world);
        check_close(train_sharded<false>(world, {}, {.clip_norm = 0.05}), train_unsharded<false>(world, {}, 0.05),
                    1e-5);
        // The clip is active: without it training ends elsewhere.
        const auto unclipped = train_sharded<false>(world, {});
        const auto clipped = train_sharded<false>(world, {}, {.clip_norm = 0.05});
        CHECK_FALSE(bitwise_equal(unclipped, clipped));
    }
}

TEST_CASE("a non-finite gradient on one rank skips the step on every rank, parameters untouched") {
    gradsync::spawn(3, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend);
        ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        model.forward_backward(batch_of(3, backend.rank(), 0));
        if (backend.rank() == 2) model.gw1[5] = std::numeric_limits<float>::infinity();
        const auto before = weights_of(model);
        bool called = false;
        const auto report = sdp.step([&](Pieces) { called = true; });
        CHECK_FALSE(report.applied);
        CHECK_FALSE(called);
        CHECK(std::isnan(report.grad_norm));
        CHECK(weights_of(model) == before);
        // The next step goes on.
        model.forward_backward(batch_of(3, backend.rank(), 1));
        CHECK(sdp.step(sgd).applied);
        CHECK(sdp.steps() == 2);
    });
}

TEST_CASE("ShardedDataParallel refuses what it cannot step, on every rank alike") {
    struct Mixed {
        std::vector<float> w = std::vector<float>(10), g = std::vector<float>(10);
        std::vector<double> d = std::vector<double>(4), dg = std::vector<double>(4);
        std::vector<gradsync::Parameter> parameters() {
            return {gradsync::parameter("w", w, g), gradsync::parameter("d", d, dg)};
        }
    };
    std::vector<std::string> messages(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        Mixed m;
        try {
            gradsync::ShardedDataParallel sdp(m, backend);
        } catch (const gradsync::ConfigurationError& e) {
            messages[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    for (const auto& m : messages) {
        CAPTURE(m);
        CHECK(m.find("ShardedDataParallel steps float32 parameters only; 'd' is float64") != std::string::npos);
    }
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        CHECK_THROWS_AS(gradsync::ShardedDataParallel(
                            model, backend, gradsync::ShardedOptions{.clip_norm = backend.rank() == 0 ? 1.0 : 2.0}),
                        gradsync::ConfigurationError);
    });
}

TEST_CASE("an optimizer that throws on one rank fails its peers at once, not at the deadline") {
    std::vector<std::string> messages(3);
    const auto start = std::chrono::steady_clock::now();
    gradsync::spawn(3, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend);
        model.forward_backward(batch_of(3, backend.rank(), 0));
        try {
            (void)sdp.step([&](Pieces) {
                if (backend.rank() == 1) throw std::runtime_error("out of memory in the optimizer");
            });
        } catch (const std::exception& e) {
            messages[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));  // the deadline is 600 s
    CHECK(messages[1] == "out of memory in the optimizer");
    for (int r : {0, 2}) {
        CAPTURE(messages[static_cast<std::size_t>(r)]);
        CHECK(messages[static_cast<std::size_t>(r)].find(
                  "gradsync: rank 1 failed in step 1: out of memory in the optimizer") != std::string::npos);
    }
}

namespace {

// Each rank's batch of a step in two halves, accumulated in the model's gradients (half the loss
// each) before one step: sharded or not (no_sync for the first half).
mlp::Batch half_of(int world, int rank, int step, int half) {
    const int global = world * micro_batch;
    return mlp::make_batch(data_seed,
                           static_cast<std::size_t>(step * global + rank * micro_batch + half * micro_batch / 2),
                           micro_batch / 2);
}

Weights train_accumulating(int world, bool sharded_mode) {
    Weights result;
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(/*seed=*/1);
        std::optional<gradsync::ShardedDataParallel<mlp::Mlp, gradsync::LocalBackend>> sdp;
        std::optional<gradsync::DataParallel<mlp::Mlp, gradsync::LocalBackend>> dp;
        ShardedAdam sharded_adam;
        mlp::Adam adam(1e-3f);
        if (sharded_mode) {
            sdp.emplace(model, backend);
            sharded_adam.m1.assign(sdp->state_elements(), 0.0f);
            sharded_adam.m2.assign(sdp->state_elements(), 0.0f);
        } else {
            dp.emplace(model, backend);
        }
        for (int s = 0; s < steps; ++s) {
            if (sharded_mode) {
                model.forward_backward(half_of(world, backend.rank(), s, 0), 0.5f);
                model.forward_backward(half_of(world, backend.rank(), s, 1), 0.5f, /*accumulate=*/true);
                CHECK(sdp->step(sharded_adam).applied);
            } else {
                {
                    auto guard = dp->no_sync();
                    model.forward_backward(half_of(world, backend.rank(), s, 0), 0.5f);
                    dp->synchronize();  // communicates nothing
                }
                model.forward_backward(half_of(world, backend.rank(), s, 1), 0.5f, /*accumulate=*/true);
                CHECK(dp->step([&] { adam.step(model); }).applied);
            }
        }
        if (backend.rank() == 0) result = weights_of(model);
    });
    return result;
}

}  // namespace

TEST_CASE("gradient accumulation: micro-batches summed in the model before one sharded step == unsharded") {
    // The sharded step reduces at step() only, so accumulating needs no guard: backward twice, step once.
    for (int world : {2, 3}) {
        CAPTURE(world);
        const auto sharded = train_accumulating(world, true);
        CHECK(bitwise_equal(sharded, train_accumulating(world, false)));
        check_close(sharded, train_single<true>(world), 1e-5);
    }
}

TEST_CASE("sharded overlap: grad_ready twice, or for a parameter the model lacks, is a ReadinessError") {
    gradsync::spawn(1, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend);
        sdp.grad_ready(std::size_t{3});
        CHECK_THROWS_WITH_AS(sdp.grad_ready("fc2.bias"), doctest::Contains("'fc2.bias' was called twice in one step"),
                             gradsync::ReadinessError);
        CHECK_THROWS_WITH_AS(sdp.grad_ready(std::size_t{9}), doctest::Contains("the model has 4 parameters"),
                             gradsync::ReadinessError);
        ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        model.forward_backward(batch_of(1, 0, 0));
        CHECK(sdp.step(sgd).applied);
        sdp.grad_ready(std::size_t{3});  // a new step: allowed again
    });
}

namespace {

// Training with a dynamic loss scale that grows every 3 steps; on step 4 the last rank's
// gradients overflow. Returns rank 0's weights, and each step's loss scale and outcome.
struct ScaledRun {
    Weights weights;
    std::vector<float> scales;
    std::vector<bool> applied;
    std::vector<std::vector<std::string>> overflowed;
};

template <bool Sharded>
ScaledRun train_scaled(int world) {
    ScaledRun run;
    const gradsync::SizeCappedBuckets caps{.cap = 64_KiB, .first_cap = 4_KiB};
    const gradsync::DynamicLossScale scaler{.init_scale = 1024.0f, .growth_interval = 3};
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(/*seed=*/1);
        auto train = [&](auto& front, auto&& step) {
            for (int s = 0; s < steps; ++s) {
                model.forward_backward(batch_of(world, backend.rank(), s), front.loss_scale());
                if (s == 4 && backend.rank() == world - 1) model.gb2[0] = std::numeric_limits<float>::infinity();
                const auto report = step();
                if (backend.rank() != 0) continue;
                run.scales.push_back(report.loss_scale);
                run.applied.push_back(report.applied);
                run.overflowed.push_back(report.overflowed);
            }
        };
        if constexpr (Sharded) {
            gradsync::ShardedDataParallel sdp(model, backend, caps, scaler);
            ShardedSgd sgd;
            sgd.velocity.assign(sdp.state_elements(), 0.0f);
            train(sdp, [&] { return sdp.step(sgd); });
        } else {
            gradsync::DataParallel dp(model, backend, caps, scaler);
            mlp::Sgd sgd(0.05f, 0.9f);
            train(dp, [&] { return dp.step([&] { sgd.step(model); }); });
        }
        if (backend.rank() == 0) run.weights = weights_of(model);
    });
    return run;
}

}  // namespace

TEST_CASE("sharded with a dynamic loss scale: unscaled, grown and backed off as DataParallel does, bitwise") {
    for (int world : {1, 2, 3}) {
        CAPTURE(world);
        const auto sharded = train_scaled<true>(world);
        const auto unsharded = train_scaled<false>(world);
        CHECK(bitwise_equal(sharded.weights, unsharded.weights));
        CHECK(sharded.scales == unsharded.scales);
        CHECK(sharded.applied == unsharded.applied);
        // Named on rank 0 whichever rank owns the element that overflowed, as DataParallel names it.
        CHECK(sharded.overflowed == unsharded.overflowed);
        CHECK(sharded.overflowed[4] == std::vector<std::string>{"fc2.bias"});
        REQUIRE(sharded.applied.size() == static_cast<std::size_t>(steps));
        CHECK_FALSE(sharded.applied[4]);  // the overflow skipped the step on every rank
        CHECK(sharded.scales[3] == 2048.0f);
        CHECK(sharded.scales[5] == 1024.0f);  // backed off after it
    }
}

namespace {

// The example MLP with a float buffer each rank updates on its own (a running mean) and a counter.
struct MlpWithStats : mlp::Mlp {
    using mlp::Mlp::Mlp;
    std::vector<float> running_mean = std::vector<float>(5, 0.0f);
    std::vector<std::int64_t> batches = {0};
    std::vector<gradsync::ModelBuffer> buffers() {
        return {gradsync::model_buffer("stats.running_mean", running_mean),
                gradsync::model_buffer("stats.batches", batches)};
    }
};

}  // namespace

// One step of 3 ranks under the buffer policy P; every rank's buffers afterwards.
template <class P>
void check_buffers_follow() {
    constexpr auto mode = P::mode;
    CAPTURE(int(mode));
    std::vector<std::vector<float>> means(3);
    std::vector<std::int64_t> counts(3);
    gradsync::spawn(3, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        MlpWithStats model(/*seed=*/1);
        model.running_mean.assign(5, 100.0f * float(r));  // rank 0's reaches everyone at construction...
        gradsync::ShardedDataParallel sdp(model, backend, P{});
        static_assert(std::is_same_v<typename decltype(sdp)::buffers_type, P>);
        if (mode != gradsync::BufferSync::ignore) CHECK(model.running_mean == std::vector<float>(5, 0.0f));
        ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        model.forward_backward(batch_of(3, backend.rank(), 0));
        model.running_mean.assign(5, float(r + 1));  // ...then each rank's statistics of its own batch
        model.batches[0] = static_cast<std::int64_t>(r + 1);
        CHECK(sdp.step(sgd).applied);
        means[r] = model.running_mean;
        counts[r] = model.batches[0];
    });
    for (std::size_t r = 0; r < 3; ++r) {
        CAPTURE(r);
        switch (mode) {
            case gradsync::BufferSync::broadcast_every_step:
                CHECK(means[r] == std::vector<float>(5, 1.0f));
                CHECK(counts[r] == 1);
                break;
            case gradsync::BufferSync::average_every_step:
                CHECK(means[r] == std::vector<float>(5, 2.0f));  // (1 + 2 + 3) / 3
                CHECK(counts[r] == 1);                           // integers are broadcast, not averaged
                break;
            default:  // once (at construction only) or ignored: each rank's own after the step
                CHECK(means[r] == std::vector<float>(5, float(r + 1)));
                CHECK(counts[r] == std::int64_t(r + 1));
        }
    }
}

TEST_CASE("sharded model buffers follow DataParallel's buffer policies: broadcast, averaged, once, or left alone") {
    check_buffers_follow<gradsync::BroadcastBuffers>();
    check_buffers_follow<gradsync::AverageBuffers>();
    check_buffers_follow<gradsync::BroadcastBuffersOnce>();
    check_buffers_follow<gradsync::IgnoreBuffers>();
}

TEST_CASE("sharded through a backend without scattered collectives: packed buffers, the same bits") {
    using Packed = gradsync::ShardedDataParallel<mlp::Mlp, sharded::BufferOnly, gradsync::SizeCappedBuckets>;
    static_assert(!Packed::in_place);
    const gradsync::SizeCappedBuckets caps{.cap = 64_KiB, .first_cap = 4_KiB};
    for (int world = 1; world <= 3; ++world) {
        CAPTURE(world);
        Weights packed;
        gradsync::spawn(world, [&](gradsync::LocalBackend& local) {
            sharded::BufferOnly backend{local};
            mlp::Mlp model(/*seed=*/1);
            Packed sdp(model, backend, caps);
            // A packed buffer per bucket for gradients and one for parameters, and a little bookkeeping.
            const gradsync::Bytes buffers{2 * sdp.parameter_elements() * sizeof(float)};
            CHECK(sdp.extra_memory() >= buffers);
            CHECK(sdp.extra_memory() < buffers + 1_KiB);
            if (local.rank() % 2 == 1) model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(i); };
            ShardedSgd sgd;
            sgd.velocity.assign(sdp.state_elements(), 0.0f);
            for (int s = 0; s < steps; ++s) {
                model.forward_backward(batch_of(world, local.rank(), s));
                CHECK(sdp.step(sgd).applied);
            }
            if (local.rank() == 0) packed = weights_of(model);
        });
        CHECK(bitwise_equal(packed, train_sharded<false>(world, caps)));
    }
}
