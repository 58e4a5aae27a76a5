// ShardedDataParallel with a communication hook: the hook averages each bucket, packed, in place
// of the reduce-scatter, and each rank reads its shard of the average. The plain average through a
// hook ends bitwise where no hook does; PowerSGD ends bitwise where DataParallel with PowerSGD does
// (the same hook over the same buckets, and an elementwise optimizer); a world of one runs no hook.
// The hook is agreed like every other setting, and release_gradients refuses one. Its state goes
// into checkpoints beside the optimizer's shards.
#include <gradsync/backend/local.hpp>
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/reduction/powersgd.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "support/sharded_training.hpp"
#include "support/temp_dir.hpp"

#include <string>
#include <vector>

using namespace gradsync::literals;

namespace {

const gradsync::SizeCappedBuckets caps{.cap = 16_KiB, .first_cap = 4_KiB};

gradsync::PowerSGD low_rank() { return gradsync::PowerSGD({.rank = 2}); }

}  // namespace

TEST_CASE("sharded with a hook: the plain average through it ends bitwise where no hook does, with overlap too") {
    for (int world = 1; world <= 3; ++world) {
        CAPTURE(world);
        const auto plain = sharded::train_sharded<false>(world, caps, {}, /*overlapping=*/1);
        const auto hooked = sharded::train_sharded<false>(world, caps, {}, 1, gradsync::AllreduceHook{});
        CHECK(sharded::bitwise_equal(hooked, plain));
        const auto adam = sharded::train_sharded<true>(world, caps, {}, world, gradsync::AllreduceHook{});
        CHECK(sharded::bitwise_equal(adam, sharded::train_sharded<true>(world, caps, {}, world)));
    }
}

TEST_CASE("sharded with PowerSGD ends bitwise where DataParallel with PowerSGD does, and alone runs no hook") {
    for (int world = 2; world <= 3; ++world) {
        CAPTURE(world);
        const auto sharded_powersgd = sharded::train_sharded<false>(world, caps, {}, 0, low_rank());
        CHECK(sharded::bitwise_equal(sharded_powersgd, sharded::train_unsharded<false>(world, caps, 0, low_rank())));
        // ...and the hook did compress: the plain average ends elsewhere.
        CHECK_FALSE(sharded::bitwise_equal(sharded_powersgd, sharded::train_sharded<false>(world, caps)));
        // Overlapped on some ranks: the same bits on every rank (train_sharded checks), and the same
        // result as without overlap.
        CHECK(sharded::bitwise_equal(sharded::train_sharded<false>(world, caps, {}, 1, low_rank()), sharded_powersgd));
    }
    // Alone, the local gradient is the average: PowerSGD would only lose precision, so it does not run.
    CHECK(sharded::bitwise_equal(sharded::train_sharded<false>(1, caps, {}, 0, low_rank()),
                                 sharded::train_sharded<false>(1, caps)));
}

TEST_CASE("sharded with a hook: hooks that differ are refused on every rank, and release_gradients refuses one") {
    std::vector<std::string> differ(2), released(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        mlp::Mlp model(1);
        try {
            gradsync::ShardedDataParallel sdp(model, backend, caps,
                                              gradsync::PowerSGD({.rank = backend.rank() == 0 ? 2u : 4u}));
        } catch (const gradsync::ConfigurationError& e) {
            differ[r] = e.what();
        }
        sharded::ReleasingMlp releasing(1);
        try {
            gradsync::ShardedDataParallel sdp(releasing, backend, caps, gradsync::AllreduceHook{},
                                              gradsync::ShardedOptions{.release_gradients = true});
        } catch (const gradsync::ConfigurationError& e) {
            released[r] = e.what();
        }
    });
    for (const auto& what : differ) {
        CAPTURE(what);
        CHECK(what.find("communication hook") != std::string::npos);
        CHECK(what.find("PowerSGD rank 2") != std::string::npos);
        CHECK(what.find("PowerSGD rank 4") != std::string::npos);
    }
    for (const auto& what : released) {
        CAPTURE(what);
        CHECK(what.find("ShardedOptions::release_gradients keeps each bucket's share as soon as it is reduced, and a "
                        "communication hook finishes its buckets only at step()") != std::string::npos);
    }
}

TEST_CASE("sharded with PowerSGD: its state and the optimizer's shards are checkpointed, 6 steps == 3, save, load, 3") {
    TempDir dir;
    const auto path = dir.path / "sharded_powersgd.safetensors";
    const int world = 2;
    // Steps [from, to) of sharded SGD with momentum under PowerSGD; loads `load` first, saves to
    // `save` after, where given. Rank 0's weights.
    const auto train = [&](int from, int to, bool load, bool save) {
        sharded::Weights weights;
        gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
            mlp::Mlp model(1);
            gradsync::ShardedDataParallel sdp(model, backend, caps, low_rank());
            sharded::ShardedSgd sgd;
            sgd.velocity.assign(sdp.state_elements(), 0.0f);
            auto checkpoint = [&] {
                return gradsync::Checkpoint().add_shard("velocity", std::span(sgd.velocity)).add(sdp.comm_hook());
            };
            if (load) checkpoint().load(path, sdp);
            for (int s = from; s < to; ++s) {
                model.forward_backward(sharded::batch_of(world, backend.rank(), s));
                CHECK(sdp.step(sgd).applied);
            }
            if (save) checkpoint().save(path, sdp);
            if (backend.rank() == 0) weights = sharded::weights_of(model);
        });
        return weights;
    };
    const auto straight = train(0, 6, false, false);
    (void)train(0, 3, false, true);
    CHECK(sharded::bitwise_equal(train(3, 6, true, false), straight));
}
