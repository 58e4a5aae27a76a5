// Hybrid sharding: ShardedDataParallel over TwoLevelBackend (LocalBackend groups playing nodes)
// splits the optimizer's state among a node's ranks and keeps it the same on every node. Its
// reduce_scatter leaves the job's reduction in a node shard, its all_gather stays inside the
// node; training ends bitwise where DataParallel over the same two levels ends (the same sums in
// the same order: each node's first, then across), stages 1 and 2, overlapped or not; the
// clipping norm counts each shard once.
#include <gradsync/backend/local.hpp>
#include <gradsync/backend/two_level.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/sharded_training.hpp"
#include "support/two_level_job.hpp"

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

using namespace gradsync::literals;
using gradsync_test::run_two_level;
using gradsync_test::TwoLevel;
using sharded::Weights;

namespace {

float value_of(int rank, std::size_t i) { return float((rank + 1) * int(1 + i % 5)); }

}  // namespace

TEST_CASE("hybrid sharding: reduce_scatter leaves the job's sum in a node shard, all_gather fills the node") {
    for (const auto& [nodes, per_node] : {std::pair{2, 2}, std::pair{2, 3}, std::pair{3, 1}}) {
        CAPTURE(nodes);
        CAPTURE(per_node);
        run_two_level(nodes, per_node, [&](TwoLevel& b) {
            CHECK(b.shard_ranks() == per_node);
            CHECK(b.shard_rank() == b.rank() % per_node);
            CHECK(b.replica() == b.rank() / per_node);
            const std::size_t count = 101;
            const auto mine = gradsync::shard_of(count, per_node, b.shard_rank());
            std::vector<float> whole(count), first(60), second(count - 60);
            for (std::size_t i = 0; i < count; ++i) {
                whole[i] = value_of(b.rank(), i);
                (i < 60 ? first[i] : second[i - 60]) = value_of(b.rank(), i);
            }
            // One buffer, asynchronously; then the same values as two segments.
            b.reduce_scatter_async(std::span<float>(whole)).wait();
            const gradsync::Segment segs[] = {{first.data(), first.size()}, {second.data(), second.size()}};
            b.reduce_scatter(segs, gradsync::DType::float32);
            for (std::size_t i = mine.offset; i < mine.offset + mine.count; ++i) {
                float sum = 0;
                for (int r = 0; r < b.size(); ++r) sum += value_of(r, i);
                REQUIRE(whole[i] == sum);
                REQUIRE((i < 60 ? first[i] : second[i - 60]) == sum);
            }
            // Each rank writes its place on its node into its shard; the node's other shards fill
            // in, and nothing of another node's comes (every node holds the same).
            for (std::size_t i = mine.offset; i < mine.offset + mine.count; ++i) whole[i] = float(b.shard_rank());
            b.all_gather_async(std::span<float>(whole)).wait();
            for (int owner = 0; owner < per_node; ++owner) {
                const auto theirs = gradsync::shard_of(count, per_node, owner);
                for (std::size_t i = theirs.offset; i < theirs.offset + theirs.count; ++i)
                    REQUIRE(whole[i] == float(owner));
            }
        });
    }
}

namespace {

// Every rank's weights after each step of sharded training over 2 nodes x 2 ranks, and each
// rank's state_elements(); total: the model's elements.
struct HybridRun {
    std::vector<std::vector<Weights>> per_step = std::vector<std::vector<Weights>>(4);
    std::vector<std::size_t> state = std::vector<std::size_t>(4);
    std::size_t total = 0;
};

template <bool Adam, class Model = mlp::Mlp>
HybridRun train_hybrid(gradsync::SizeCappedBuckets caps, gradsync::ShardedOptions options, int overlapping) {
    HybridRun run;
    run_two_level(2, 2, [&](TwoLevel& b) {
        const auto r = static_cast<std::size_t>(b.rank());
        std::size_t total = 0;
        run.per_step[r] = sharded::train_sharded_rank<Adam, Model>(b, caps, options, overlapping, run.state[r], total);
        if (r == 0) run.total = total;
    });
    return run;
}

Weights train_unsharded_two_level(gradsync::SizeCappedBuckets caps, bool adam, double clip = 0) {
    Weights result;
    run_two_level(2, 2, [&](TwoLevel& b) {
        auto mine = adam ? sharded::train_unsharded_rank<true>(b, caps, clip)
                         : sharded::train_unsharded_rank<false>(b, caps, clip);
        if (b.rank() == 0) result = std::move(mine);
    });
    return result;
}

template <bool Adam, class Model = mlp::Mlp>
void check_hybrid(gradsync::ShardedOptions options) {
    const gradsync::SizeCappedBuckets caps[] = {gradsync::SizeCappedBuckets{},
                                                gradsync::SizeCappedBuckets{.cap = 64_KiB, .first_cap = 4_KiB}};
    const auto single = sharded::train_single<Adam>(4);
    for (const auto& c : caps) {
        CAPTURE(c.settings());
        const auto unsharded = train_unsharded_two_level(c, Adam);
        // Overlapped with backward where there are several buckets to overlap (the small caps).
        for (const int overlapping : {0, 4}) {
            if (overlapping > 0 && &c == &caps[0]) continue;
            CAPTURE(overlapping);
            const auto run = train_hybrid<Adam, Model>(c, options, overlapping);
            for (const auto& w : run.per_step) CHECK(w == run.per_step[0]);  // every rank, every step
            CHECK(sharded::bitwise_equal(run.per_step[0].back(), unsharded));
            sharded::check_close(run.per_step[0].back(), single, 1e-5);
            // Half the state on each rank of a node, the same split on both nodes.
            CHECK(run.state[0] + run.state[1] == run.total);
            CHECK(run.state[2] == run.state[0]);
            CHECK(run.state[3] == run.state[1]);
            CHECK(run.state[0] * 2 <= run.total + 2 * 8);
        }
    }
}

}  // namespace

TEST_CASE("hybrid sharding, 2 nodes x 2 ranks: == DataParallel over the same two levels bitwise (SGD, stage 1)") {
    check_hybrid<false>({});
}

TEST_CASE("hybrid sharding, 2 nodes x 2 ranks: == DataParallel over the same two levels bitwise (Adam, stage 1)") {
    check_hybrid<true>({});
}

TEST_CASE("hybrid sharding, 2 nodes x 2 ranks: stage 2 (gradients released) ends in the same bits") {
    check_hybrid<false, sharded::ReleasingMlp>({.release_gradients = true});
}

TEST_CASE("hybrid sharding: the clipping norm counts each shard once, not once per node") {
    // Clipped as DataParallel over the same levels clips: a norm counted twice would clip less.
    const auto clipped = train_hybrid<false>({}, {.clip_norm = 0.05}, 0).per_step[0].back();
    sharded::check_close(clipped, train_unsharded_two_level({}, false, 0.05), 1e-5);
    CHECK_FALSE(sharded::bitwise_equal(clipped, train_hybrid<false>({}, {}, 0).per_step[0].back()));
    // The norm each step reports is the flat job's.
    std::vector<double> hybrid_norm(4), flat_norm(4);
    auto first_norm = [](auto& backend, double& norm) {
        mlp::Mlp model(1);
        gradsync::ShardedDataParallel sdp(model, backend);
        model.forward_backward(sharded::batch_of(4, backend.rank(), 0));
        norm = sdp.step([](sharded::Pieces) {}).grad_norm;
    };
    run_two_level(2, 2, [&](TwoLevel& b) { first_norm(b, hybrid_norm[static_cast<std::size_t>(b.rank())]); });
    gradsync::spawn(4,
                    [&](gradsync::LocalBackend& b) { first_norm(b, flat_norm[static_cast<std::size_t>(b.rank())]); });
    for (std::size_t r = 0; r < 4; ++r) {
        CAPTURE(r);
        CHECK(hybrid_norm[r] > 0);
        CHECK(std::abs(hybrid_norm[r] - flat_norm[0]) <= 1e-5 * flat_norm[0]);
    }
}
