// ShardedDataParallel takes its policies as DataParallel does: in any order, each optional, one of
// each kind, agreed across the ranks by value. A rank may even list them in another order than
// its peers; what counts is which policies and which values.
#include <gradsync/backend/local.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/sharded_optimizers.hpp"
#include "support/sharded_training.hpp"

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

using namespace gradsync::literals;

namespace {

constexpr int world = 3;
const gradsync::SizeCappedBuckets caps{.cap = 16_KiB, .first_cap = 2_KiB};
const gradsync::ShardedOptions clipped{.clip_norm = 1e-3};
const gradsync::StaticLossScale scale{.value = 256.0f};

// Six steps of the MLP on this rank; its weights after each.
template <class Sharded>
std::vector<sharded::Weights> train(Sharded& sdp, mlp::Mlp& model, bool expect_clipped) {
    sharded::ShardedSgd sgd;
    sgd.velocity.assign(sdp.state_elements(), 0.0f);
    std::vector<sharded::Weights> out;
    for (int s = 0; s < 6; ++s) {
        model.forward_backward(sharded::batch_of(world, sdp.rank(), s), sdp.loss_scale());
        const auto report = sdp.step(sgd);
        CHECK(report.applied);
        CHECK(report.loss_scale == sdp.loss_scale());
        CHECK(report.clipped == expect_clipped);
        out.push_back(sharded::weights_of(model));
    }
    return out;
}

}  // namespace

TEST_CASE("sharded policies in any order: each applies, and ranks that list them in other orders agree") {
    std::vector<std::vector<sharded::Weights>> one_order(world), own_orders(world);
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(/*seed=*/1);
        gradsync::ShardedDataParallel sdp(model, backend, caps, clipped, scale, gradsync::AverageBuffers{});
        static_assert(std::is_same_v<decltype(sdp)::loss_scaler_type, gradsync::StaticLossScale>);
        static_assert(std::is_same_v<decltype(sdp)::buffers_type, gradsync::AverageBuffers>);
        static_assert(std::is_same_v<decltype(sdp)::bucketer_type, gradsync::SizeCappedBuckets>);
        CHECK(sdp.loss_scale() == 256.0f);
        CHECK(sdp.plan() == caps.plan(sdp.parameters()));  // the caps given, not the default ones
        CHECK(sdp.plan() != gradsync::SizeCappedBuckets{}.plan(sdp.parameters()));
        one_order[static_cast<std::size_t>(backend.rank())] = train(sdp, model, /*expect_clipped=*/true);
    });
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(/*seed=*/1);
        auto& mine = own_orders[static_cast<std::size_t>(backend.rank())];
        if (backend.rank() == 0) {
            gradsync::ShardedDataParallel sdp(model, backend, scale, gradsync::AverageBuffers{}, clipped, caps);
            mine = train(sdp, model, true);
        } else if (backend.rank() == 1) {
            gradsync::ShardedDataParallel sdp(model, backend, clipped, caps, gradsync::AverageBuffers{}, scale);
            mine = train(sdp, model, true);
        } else {
            gradsync::ShardedDataParallel sdp(model, backend, gradsync::AverageBuffers{}, scale, caps, clipped);
            mine = train(sdp, model, true);
        }
    });
    for (int r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK(one_order[static_cast<std::size_t>(r)] == one_order[0]);  // float ==: bitwise (no NaN)
        CHECK(own_orders[static_cast<std::size_t>(r)] == one_order[0]);
    }
}

TEST_CASE("sharded: any bucketer policy plans the buckets, with the same bits where sums follow rank order") {
    // LocalBackend sums in rank order whatever the buckets, and SGD is elementwise: the plan
    // changes nothing but how the work is cut.
    std::vector<sharded::Weights> per_parameter(world), single(world), capped(world);
    std::vector<std::size_t> buckets(3);
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        {
            mlp::Mlp model(1);
            gradsync::ShardedDataParallel sdp(model, backend, gradsync::PerParameterBuckets{});
            if (r == 0) buckets[0] = sdp.plan().buckets.size();
            per_parameter[r] = train(sdp, model, false).back();
        }
        {
            mlp::Mlp model(1);
            gradsync::ShardedDataParallel sdp(model, backend, gradsync::SingleBucket{});
            if (r == 0) buckets[1] = sdp.plan().buckets.size();
            single[r] = train(sdp, model, false).back();
        }
        {
            mlp::Mlp model(1);
            gradsync::ShardedDataParallel sdp(model, backend, caps);
            if (r == 0) buckets[2] = sdp.plan().buckets.size();
            capped[r] = train(sdp, model, false).back();
        }
    });
    CHECK(buckets[0] == 4);  // fc1.weight, fc1.bias, fc2.weight, fc2.bias
    CHECK(buckets[1] == 1);
    CHECK(buckets[2] > 1);
    for (std::size_t r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK(sharded::bitwise_equal(per_parameter[r], capped[0]));
        CHECK(sharded::bitwise_equal(single[r], capped[0]));
        CHECK(sharded::bitwise_equal(capped[r], capped[0]));
    }
}

TEST_CASE("sharded: ranks given different policies refuse alike, naming the setting and both values") {
    std::vector<std::string> buffers(2), scalers(2), bucketers(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        mlp::Mlp model(1);
        try {
            if (r == 0)
                gradsync::ShardedDataParallel sdp(model, backend, gradsync::BroadcastBuffers{});
            else
                gradsync::ShardedDataParallel sdp(model, backend, gradsync::AverageBuffers{});
        } catch (const gradsync::ConfigurationError& e) {
            buffers[r] = e.what();
        }
        try {
            gradsync::ShardedDataParallel sdp(model, backend,
                                              gradsync::StaticLossScale{.value = r == 0 ? 256.0f : 512.0f});
        } catch (const gradsync::ConfigurationError& e) {
            scalers[r] = e.what();
        }
        try {
            gradsync::ShardedDataParallel sdp(model, backend,
                                              gradsync::SizeCappedBuckets{.cap = r == 0 ? 16_KiB : 32_KiB});
        } catch (const gradsync::ConfigurationError& e) {
            bucketers[r] = e.what();
        }
    });
    for (std::size_t r = 0; r < 2; ++r) {
        CAPTURE(r);
        CHECK(buffers[r] == buffers[0]);
        CHECK(
            buffers[r].find("buffer policy is 'broadcast every step' on rank 0 but 'averaged every step' on rank 1") !=
            std::string::npos);
        CHECK(scalers[r] == scalers[0]);
        CHECK(scalers[r].find("loss scaler is 'static 256' on rank 0 but 'static 512' on rank 1") != std::string::npos);
        CHECK(bucketers[r] == bucketers[0]);
        CHECK(bucketers[r].find("bucketer is '") != std::string::npos);
    }
}

TEST_CASE("sharded: a policy's own check refuses a bad value on every rank") {
    std::vector<std::string> what(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        try {
            gradsync::ShardedDataParallel sdp(model, backend, gradsync::StaticLossScale{.value = -1.0f});
        } catch (const gradsync::ConfigurationError& e) {
            what[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    for (const auto& w : what) {
        CAPTURE(w);
        CHECK(w.find("StaticLossScale needs a finite value above 0") != std::string::npos);
    }
}

TEST_CASE("sharded: the policies of docs/sharding.md's example apply") {
    gradsync::spawn(2, [](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        // [sharded_policies]
        gradsync::ShardedDataParallel sdp(model, backend, gradsync::ShardedOptions{.clip_norm = 1.0},
                                          gradsync::DynamicLossScale{}, gradsync::SizeCappedBuckets{.cap = 8_MiB});
        // [/sharded_policies]
        CHECK(sdp.loss_scale() == 65536.0f);  // DynamicLossScale's initial scale
        CHECK(sdp.plan() == gradsync::SizeCappedBuckets{.cap = 8_MiB}.plan(sdp.parameters()));
        CHECK(sdp.options().clip_norm == 1.0);
        model.forward_backward(sharded::batch_of(2, backend.rank(), 0), sdp.loss_scale());
        sharded::ShardedSgd sgd;
        sgd.velocity.assign(sdp.state_elements(), 0.0f);
        const auto report = sdp.step(sgd);
        CHECK(report.loss_scale == 65536.0f);
        CHECK(report.clipped == (report.applied && report.grad_norm > 1.0));
    });
}

namespace {

// A host memory policy of the user's: HostMemory's passes, counted across its copies.
struct CountedHostMemory : gradsync::HostMemory {
    std::shared_ptr<int> finalized = std::make_shared<int>(0), scaled = std::make_shared<int>(0);
    [[nodiscard]] std::string settings() const { return "host, counted"; }
    void finalize(const Table& t, const std::byte* src, gradsync::DType type, double factor, std::size_t slot) {
        ++*finalized;
        HostMemory::finalize(t, src, type, factor, slot);
    }
    void scale(const Table& t, double factor) const {
        ++*scaled;
        HostMemory::scale(t, factor);
    }
};

}  // namespace

TEST_CASE("sharded: a host memory policy of the user's carries the step's passes, with the same bits") {
    std::vector<sharded::Weights> plain(world), counted(world);
    std::vector<int> finalized(world), scaled(world);
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        {
            mlp::Mlp model(1);
            gradsync::ShardedDataParallel sdp(model, backend, caps, clipped);
            plain[r] = train(sdp, model, /*expect_clipped=*/true).back();
        }
        mlp::Mlp model(1);
        const CountedHostMemory memory;
        gradsync::ShardedDataParallel sdp(model, backend, memory, caps, clipped);
        static_assert(std::is_same_v<decltype(sdp)::memory_type, CountedHostMemory>);
        counted[r] = train(sdp, model, true).back();
        finalized[r] = *memory.finalized;
        scaled[r] = *memory.scaled;
    });
    for (std::size_t r = 0; r < world; ++r) {
        CAPTURE(r);
        CHECK(sharded::bitwise_equal(counted[r], plain[0]));
        CHECK(finalized[r] == 6);  // each step's norm with the unscale: one pass over this rank's shards
        CHECK(scaled[r] == 6);     // and each step's clipping
    }
}

TEST_CASE("sharded: ranks given different memory policies refuse alike, naming both") {
    std::vector<std::string> what(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        mlp::Mlp model(1);
        try {
            if (backend.rank() == 0)
                gradsync::ShardedDataParallel sdp(model, backend, gradsync::HostMemory{});
            else
                gradsync::ShardedDataParallel sdp(model, backend, CountedHostMemory{});
        } catch (const gradsync::ConfigurationError& e) {
            what[static_cast<std::size_t>(backend.rank())] = e.what();
        }
    });
    CHECK(what[1] == what[0]);
    CHECK(what[0].find("memory policy is 'host' on rank 0 but 'host, counted' on rank 1") != std::string::npos);
}
