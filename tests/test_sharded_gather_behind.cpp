// ShardedOptions::gather_behind_forward: step() leaves the parameters' all-gathers in flight and
// the forward waits per bucket (param_ready) before reading; training ends bitwise where the
// gathers waited for in step() end, in place and packed, stage 1 and 2, overlapped or not. A
// forward that reads without waiting fails the group naming the parameter; checkpoints, the
// destructor and wait_for_parameters() wait for what is in flight.
#include <gradsync/backend/local.hpp>
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/fake_device.hpp"
#include "support/sharded_optimizers.hpp"
#include "support/sharded_training.hpp"
#include "support/temp_dir.hpp"

#include <cstddef>
#include <exception>
#include <string>
#include <vector>

using namespace gradsync::literals;
using sharded::batch_of;
using sharded::bitwise_equal;
using sharded::ShardedSgd;
using sharded::train_sharded;
using sharded::train_sharded_over;
using sharded::Weights;
using sharded::weights_of;

namespace {

const gradsync::ShardedOptions behind{.gather_behind_forward = true};
const gradsync::SizeCappedBuckets caps[] = {gradsync::SizeCappedBuckets{},
                                            gradsync::SizeCappedBuckets{.cap = 1_KiB, .first_cap = 1_KiB}};

}  // namespace

TEST_CASE("gathers behind the forward == gathers in step() bitwise, N = 1..4, in place and packed, overlapped or not") {
    for (int world = 1; world <= 4; ++world) {
        CAPTURE(world);
        for (const auto& c : caps) {
            CAPTURE(c.settings());
            const auto waited = train_sharded<false>(world, c);
            CHECK(bitwise_equal(train_sharded<false>(world, c, behind), waited));
            CHECK(bitwise_equal(train_sharded<false>(world, c, behind, world), waited));
            CHECK(bitwise_equal(train_sharded_over<true, mlp::Mlp, true>(world, c, behind, world),
                                train_sharded_over<true, mlp::Mlp, true>(world, c, {}, world)));
        }
    }
}

TEST_CASE("gathers behind the forward with released gradients (stage 2) == stage 1 bitwise") {
    gradsync::ShardedOptions stage2_behind = behind;
    stage2_behind.release_gradients = true;
    for (int world : {2, 3}) {
        CAPTURE(world);
        const auto stage1 = train_sharded<false>(world, caps[1]);
        CHECK(bitwise_equal(train_sharded<false, sharded::ReleasingMlp>(world, caps[1], stage2_behind, world), stage1));
        CHECK(bitwise_equal(train_sharded<false, sharded::ReleasingMlp>(world, caps[1], stage2_behind), stage1));
    }
}

TEST_CASE("param_ready makes exactly the parameter's bucket current, wait_for_parameters the rest") {
    // Reference: the weights after one step with the gathers waited for in step().
    std::vector<Weights> expected(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend, caps[1]);
        ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        model.forward_backward(batch_of(2, backend.rank(), 0));
        sdp.step(sgd);
        expected[static_cast<std::size_t>(backend.rank())] = weights_of(model);
    });
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend, caps[1], behind);
        REQUIRE(sdp.plan().buckets.size() == 4);  // one parameter each
        ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        model.forward_backward(batch_of(2, backend.rank(), 0));
        sdp.step(sgd);
        const auto& want = expected[static_cast<std::size_t>(backend.rank())];
        sdp.param_ready("fc2.weight");
        CHECK(model.w2 == want[2]);
        sdp.param_ready(0);  // fc1.weight
        CHECK(model.w1 == want[0]);
        sdp.param_ready(0);  // again: at once
        sdp.wait_for_parameters();
        CHECK(weights_of(model) == want);
    });
}

TEST_CASE("a forward that reads a parameter without waiting fails the group, naming the parameter") {
    for (const bool overlapped : {false, true}) {
        CAPTURE(overlapped);
        std::vector<std::string> errors(2);
        gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
            mlp::Mlp model(1);
            gradsync::ShardedDataParallel sdp(model, backend, caps[1], behind);
            if (overlapped) model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(i); };
            model.before_read = [&](std::size_t i) { sdp.param_ready(i); };
            ShardedSgd sgd;
            sgd.velocity.assign(sdp.state_elements(), 0.0f);
            model.forward_backward(batch_of(2, backend.rank(), 0));
            sdp.step(sgd);
            try {
                if (backend.rank() == 1) {
                    model.forward_backward(batch_of(2, backend.rank(), 1));
                } else {
                    // Rank 0's forward skipped param_ready: it stands here for one that read the
                    // parameters anyway (this one does not, so that no test races the gathers).
                    for (auto* g : {&model.gw1, &model.gb1, &model.gw2, &model.gb2}) g->assign(g->size(), 0.5f);
                    if (overlapped)
                        for (std::size_t i : {3, 2, 1, 0}) sdp.grad_ready(i);  // as backward reports them
                }
                sdp.step(sgd);
            } catch (const std::exception& e) {
                errors[static_cast<std::size_t>(backend.rank())] = e.what();
            }
        });
        // Without grad_ready, step() finds the first parameter the forward reads; with it, the
        // first gradient backward reports (the last layer's).
        const std::string name = overlapped ? "fc2.bias" : "fc1.weight";
        CHECK(errors[0].find("rank 0") != std::string::npos);
        CHECK(errors[0].find("parameter '" + name + "' was not waited for") != std::string::npos);
        CHECK(errors[0].find("param_ready(\"" + name + "\")") != std::string::npos);
        CHECK(errors[1].find("rank 0") != std::string::npos);  // the peer names the culprit
    }
}

TEST_CASE("param_ready of a parameter the model lacks is refused with its call named") {
    gradsync::spawn(1, [&](gradsync::LocalBackend& solo) {
        mlp::Mlp model(1);
        gradsync::ShardedDataParallel sdp(model, solo, behind);
        CHECK_THROWS_WITH_AS(sdp.param_ready(7), doctest::Contains("param_ready(7) but the model has 4 parameters"),
                             gradsync::ReadinessError);
        CHECK_THROWS_WITH_AS(sdp.param_ready("fc3.weight"),
                             doctest::Contains("param_ready(\"fc3.weight\"): no parameter has this name"),
                             gradsync::ReadinessError);
    });
}

TEST_CASE("gathers left in flight: the destructor and a checkpoint wait for them") {
    TempDir dir;
    const auto path = dir.path / "after_one_step.ckpt";
    std::vector<Weights> expected(2), destroyed(2), loaded(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        ShardedSgd sgd;
        {
            mlp::Mlp model(1);
            gradsync::ShardedDataParallel sdp(model, backend, caps[1]);
            sgd.velocity.assign(sdp.state_elements(), 0.0f);
            model.forward_backward(batch_of(2, backend.rank(), 0));
            sdp.step(sgd);
            expected[r] = weights_of(model);
        }
        {
            mlp::Mlp model(1);
            {
                gradsync::ShardedDataParallel sdp(model, backend, caps[1], behind);
                sgd.velocity.assign(sdp.state_elements(), 0.0f);
                model.forward_backward(batch_of(2, backend.rank(), 0));
                sdp.step(sgd);
                gradsync::Checkpoint().save(path, sdp);  // gathers still in flight
            }
            destroyed[r] = weights_of(model);
        }
        mlp::Mlp fresh(5);
        gradsync::ShardedDataParallel sdp(fresh, backend, caps[1], behind);
        gradsync::Checkpoint().load(path, sdp);
        loaded[r] = weights_of(fresh);
    });
    for (std::size_t r = 0; r < 2; ++r) {
        CHECK(destroyed[r] == expected[r]);
        CHECK(loaded[r] == expected[r]);
    }
}

TEST_CASE("ranks that disagree on gather_behind_forward are refused at construction, on every rank") {
    std::vector<std::string> errors(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        try {
            gradsync::ShardedDataParallel sdp(model, backend,
                                              backend.rank() == 0 ? behind : gradsync::ShardedOptions{});
        } catch (const gradsync::ConfigurationError& e) {
            errors[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    for (const auto& e : errors) CHECK(e.find("ShardedOptions::gather_behind_forward") != std::string::npos);
}

TEST_CASE("gather_behind_forward on a device stream is refused on every rank, saying why") {
    std::vector<std::string> errors(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        testing_support::FakeDeviceBackend device(b);
        mlp::Mlp model(1);
        try {
            gradsync::ShardedDataParallel sdp(model, device, testing_support::FakeDeviceMemory{}, behind);
        } catch (const gradsync::ConfigurationError& e) {
            errors[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& e : errors) CHECK(e.find("gather_behind_forward needs a host backend") != std::string::npos);
}
