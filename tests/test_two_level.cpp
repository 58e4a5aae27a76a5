// TwoLevelBackend over LocalBackend groups playing nodes: 2 nodes of 2 ranks (and 2 of 3, and 3
// of 1), every collective against its exact answer, DataParallel over it == one process on the
// whole batch, only a share of each bucket crosses between nodes, a bad layout refused on every
// rank, and a failure in one level reaching the ranks waiting in the other.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/shard_training.hpp"
#include "support/two_level_job.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

using gradsync_test::run_two_level;
using gradsync_test::TwoLevel;
// What DataParallel finds in it: the scattered allreduce with tags, and abort; its shards are a
// node's, replicated across (test_hybrid_sharding.cpp).
static_assert(gradsync::TaggedScatteredAllreduce<TwoLevel>);
static_assert(gradsync::Abortable<TwoLevel>);
static_assert(gradsync::ReplicatedShards<TwoLevel>);
static_assert(!gradsync::CheckedCollectives<TwoLevel>);  // tags go to each level; histories checked by the front

float input_value(int rank, std::size_t i) { return float((rank + 1) * int(1 + i % 7)); }

}  // namespace

TEST_CASE("two levels: allreduce sums and averages exactly, numbered node by node, in one call or many") {
    for (const auto& [nodes, per_node] : {std::pair{2, 2}, std::pair{2, 3}, std::pair{3, 1}, std::pair{1, 3}}) {
        CAPTURE(nodes);
        CAPTURE(per_node);
        const int n = nodes * per_node;
        run_two_level(nodes, per_node, [&](TwoLevel& b) {
            CHECK(b.size() == n);
            CHECK(b.rank() == b.across().rank() * per_node + b.node().rank());
            for (const std::size_t count : {std::size_t{1}, std::size_t{2}, std::size_t{7}, std::size_t{1000}}) {
                CAPTURE(count);
                std::vector<float> sum(count), avg(count);
                for (std::size_t i = 0; i < count; ++i) sum[i] = avg[i] = input_value(b.rank(), i);
                auto handle = b.allreduce_async(std::span<float>(avg), gradsync::ReduceOp::average);
                b.allreduce(std::span<float>(sum));  // after the asynchronous one, in launch order
                handle.wait();
                for (std::size_t i = 0; i < count; ++i) {
                    float expected = 0;
                    for (int r = 0; r < n; ++r) expected += input_value(r, i);
                    REQUIRE(sum[i] == expected);
                    REQUIRE(std::abs(avg[i] - expected / float(n)) <= 1e-6f * expected);
                }
            }
        });
    }
}

TEST_CASE("two levels: scattered segments reduced where they lie, a share of each crossing between nodes") {
    run_two_level(2, 2, [&](TwoLevel& b) {
        std::vector<float> a(300), c(5), d(1001);
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = input_value(b.rank(), i);
        for (std::size_t i = 0; i < c.size(); ++i) c[i] = input_value(b.rank(), 300 + i);
        for (std::size_t i = 0; i < d.size(); ++i) d[i] = input_value(b.rank(), 305 + i);
        const gradsync::Segment segs[] = {{a.data(), a.size()}, {c.data(), c.size()}, {d.data(), d.size()}};
        b.allreduce_async(segs, gradsync::DType::float32).wait();
        auto expect = [](std::size_t i) {
            float s = 0;
            for (int r = 0; r < 4; ++r) s += input_value(r, i);
            return s;
        };
        for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == expect(i));
        for (std::size_t i = 0; i < c.size(); ++i) REQUIRE(c[i] == expect(300 + i));
        for (std::size_t i = 0; i < d.size(); ++i) REQUIRE(d[i] == expect(305 + i));
        CHECK(b.elements_reduced() == 1306);
        CHECK(b.elements_across() == gradsync::shard_of(1306, 2, b.node().rank()).count);  // half of it
    });
}

TEST_CASE("two levels: broadcast from every root of the job, and a barrier") {
    run_two_level(2, 3, [&](TwoLevel& b) {
        for (int root = 0; root < b.size(); ++root) {
            std::vector<std::byte> bytes(33, std::byte(b.rank() == root ? root + 1 : 0));
            b.broadcast(bytes, root);
            CHECK(bytes == std::vector<std::byte>(33, std::byte(root + 1)));
        }
        b.barrier();
        std::vector<std::byte> one(1);
        CHECK_THROWS_WITH_AS(
            b.broadcast(one, 6),
            ("gradsync: rank " + std::to_string(b.rank()) + ": broadcast from rank 6 of a group of 6").c_str(),
            gradsync::CollectiveError);
    });
}

TEST_CASE("two levels: DataParallel over 2 nodes x 2 ranks == one process with the whole batch") {
    constexpr int steps = 10, micro = 8, n = 4;
    std::vector<gradsync_test::Weights> ended(n);
    run_two_level(2, 2, [&](TwoLevel& b) {
        // Rank 0's start reaches all.
        mlp::Mlp model(gradsync_test::model_seed(0) + static_cast<std::uint64_t>(b.rank()) * 1000);
        gradsync::DataParallel dp(model, b, gradsync::SizeCappedBuckets{gradsync::Bytes{16u << 10}});
        mlp::Sgd opt(0.05f, 0.9f);
        for (int s = 0; s < steps; ++s) {
            const auto first = static_cast<std::size_t>(s * n * micro + b.rank() * micro);
            model.forward_backward(mlp::make_batch(gradsync_test::data_seed(0), first, micro));
            dp.synchronize();
            opt.step(model);
        }
        ended[static_cast<std::size_t>(b.rank())] = gradsync_test::weights_of(model);
        CHECK(b.elements_across() * 2 <= b.elements_reduced() + 2 * 64);  // about half, per bucket rounded up
    });
    const auto single = gradsync_test::train_one_process(0, n, steps, micro);
    CHECK(gradsync_test::relative_difference(ended[0], single) <= 1e-5);
    for (int r = 1; r < n; ++r) CHECK(ended[static_cast<std::size_t>(r)] == ended[0]);  // bitwise
}

TEST_CASE("two levels: nodes of different sizes are refused on every rank") {
    // Nodes {0, 1, 2} and {3}; across, the ranks in each place: {0, 3}, {1}, {2}.
    const std::vector<int> node_of = {0, 0, 0, 1}, place_of = {0, 1, 2, 0};
    auto node = gradsync::LocalBackend::split(node_of);
    auto across = gradsync::LocalBackend::split(place_of);
    std::vector<std::string> errors(4);
    gradsync::spawn(4, [&](gradsync::LocalBackend& job) {
        const auto me = static_cast<std::size_t>(job.rank());
        try {
            TwoLevel backend(node[me], across[me]);
        } catch (const gradsync::Error& e) {
            errors[me] = e.what();
        }
    });
    for (const auto& e : errors) {
        CAPTURE(e);
        CHECK(e.find("TwoLevelBackend needs the same number of ranks on every node") != std::string::npos);
    }
}

TEST_CASE("two levels: a mismatch inside one node fails the ranks waiting across, long before their deadline") {
    std::vector<std::string> errors(4);
    const auto start = std::chrono::steady_clock::now();
    run_two_level(2, 2,
                  [&](TwoLevel& b) {
                      // Rank 3 reduces a longer tensor: node 1 fails in its reduce-scatter; node 0's ranks
                      // wait for node 1 in the allreduce across, until the failure reaches them.
                      std::vector<float> data(b.rank() == 3 ? 65 : 64, 1.0f);
                      try {
                          b.allreduce(std::span<float>(data));
                      } catch (const gradsync::CollectiveError& e) {
                          errors[static_cast<std::size_t>(b.rank())] = e.what();
                      }
                  },
                  {.timeout = std::chrono::seconds(60)});
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
    for (const auto& e : errors) {
        CAPTURE(e);
        CHECK(e.find("collective mismatch") != std::string::npos);
    }
}
