// reduce_scatter and all_gather: the shard rule, and LocalBackend's collectives for every world
// size from 1 to 5, bitwise the rank-ordered reduction, with the failures that must become
// exceptions rather than hangs.
#include <gradsync/backend/concept_checks.hpp>
#include <gradsync/backend/local.hpp>
#include <gradsync/launch/spawn.hpp>

#include <doctest/doctest.h>

#include <pthread.h>  // for pthread_setaffinity_np
#include <sched.h>    // for cpu_set_t

#include "support/sharded_checks.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using gradsync::LocalBackend;
using gradsync::ReduceOp;
using gradsync::Shard;
using gradsync::shard_of;

static_assert(gradsync::ShardedCollectives<LocalBackend>);
static_assert(gradsync::TaggedShardedCollectives<LocalBackend>);
static_assert(gradsync::detail::check_sharded_collectives<LocalBackend>());

TEST_CASE("shards are contiguous, cover the buffer, and differ by at most one element, the longer ones first") {
    CHECK(shard_of(10, 3, 0) == Shard{0, 4});
    CHECK(shard_of(10, 3, 1) == Shard{4, 3});
    CHECK(shard_of(10, 3, 2) == Shard{7, 3});
    CHECK(shard_of(2, 4, 1) == Shard{1, 1});
    CHECK(shard_of(2, 4, 3) == Shard{2, 0});
    CHECK(shard_of(0, 2, 1) == Shard{0, 0});
    for (int ranks = 1; ranks <= 9; ++ranks) {
        for (std::size_t count : {0ul, 1ul, 5ul, 8ul, 9ul, 1000ul, 1001ul}) {
            std::size_t next = 0, longest = 0, shortest = count;
            for (int r = 0; r < ranks; ++r) {
                const auto s = shard_of(count, ranks, r);
                CHECK(s.offset == next);
                next += s.count;
                longest = std::max(longest, s.count);
                shortest = std::min(shortest, s.count);
                if (r > 0) CHECK(s.count <= shard_of(count, ranks, r - 1).count);
            }
            CHECK(next == count);
            CHECK(longest - shortest <= 1);
        }
    }
    CHECK_THROWS_WITH_AS(shard_of(10, 3, 3), doctest::Contains("0 <= rank < ranks, got rank 3 of 3"), gradsync::Error);
    CHECK_THROWS_AS(shard_of(10, 0, 0), gradsync::Error);
}

TEST_CASE("LocalBackend reduce_scatter and all_gather are bitwise the rank-ordered reduction, world sizes 1 to 5") {
    for (int world = 1; world <= 5; ++world)
        gradsync::spawn(world, [&](LocalBackend& b) { sharded::check_contract(b, /*exact=*/true); });
}

TEST_CASE("reduce_scatter then all_gather gives the allreduce's bits, and leaves the rest of the buffer alone") {
    const std::size_t n = 300'001;  // in many reduction blocks, not divisible by 3
    std::vector<std::vector<float>> via_shards(3), via_allreduce(3);
    gradsync::spawn(3, [&](LocalBackend& b) {
        const auto r = static_cast<std::size_t>(b.rank());
        auto v = sharded::input_of<float>(b.rank(), n, 99);
        auto w = v;
        const auto before = v;
        b.reduce_scatter(std::span<float>(v), ReduceOp::average);
        // LocalBackend writes nothing but this rank's shard.
        const auto mine = shard_of(n, 3, b.rank());
        CHECK(std::memcmp(v.data(), before.data(), mine.offset * sizeof(float)) == 0);
        CHECK(std::memcmp(v.data() + mine.offset + mine.count, before.data() + mine.offset + mine.count,
                          (n - mine.offset - mine.count) * sizeof(float)) == 0);
        b.all_gather(std::span<float>(v));
        b.allreduce(std::span<float>(w), ReduceOp::average);
        via_shards[r] = std::move(v);
        via_allreduce[r] = std::move(w);
    });
    for (std::size_t r = 0; r < 3; ++r) {
        CHECK(std::memcmp(via_shards[r].data(), via_allreduce[r].data(), n * sizeof(float)) == 0);
        CHECK(std::memcmp(via_shards[r].data(), via_shards[0].data(), n * sizeof(float)) == 0);
    }
}

TEST_CASE("all_gather moves any dtype, integers too, and keeps launch order with the other collectives") {
    gradsync::spawn(4, [&](LocalBackend& b) {
        const std::size_t n = 10;
        std::vector<std::int64_t> ids(n, -1);
        const auto mine = shard_of(n, 4, b.rank());
        for (std::size_t i = mine.offset; i < mine.offset + mine.count; ++i) ids[i] = static_cast<std::int64_t>(i * i);
        std::vector<float> grads(n, float(b.rank() + 1));
        auto h1 = b.reduce_scatter_async(std::span<float>(grads), ReduceOp::sum);
        auto h2 = b.all_gather_async(gradsync::Buffer{ids.data(), n, gradsync::DType::int64});
        auto h3 = b.all_gather_async(std::span<float>(grads));
        h3.wait();
        CHECK(h1.ready());
        CHECK(h2.ready());
        for (std::size_t i = 0; i < n; ++i) {
            CHECK(ids[i] == static_cast<std::int64_t>(i * i));
            CHECK(grads[i] == 10.0f);  // 1 + 2 + 3 + 4
        }
    });
}

TEST_CASE("sharded collectives that differ across ranks fail every rank with the same message, not a hang") {
    std::vector<std::string> messages(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        std::vector<float> v(100);
        try {
            if (b.rank() == 0)
                b.reduce_scatter(std::span<float>(v), ReduceOp::average);
            else
                b.allreduce(std::span<float>(v), ReduceOp::average);
        } catch (const gradsync::CollectiveError& e) {
            messages[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& m : messages) {
        CAPTURE(m);
        CHECK(m.find("collective mismatch: rank 0 is in reduce_scatter #1 of 100 x float32 (400 B), average but rank "
                     "1 is in allreduce #1 of 100 x float32 (400 B), average") != std::string::npos);
    }

    std::vector<std::string> sizes(3);
    gradsync::spawn(3, [&](LocalBackend& b) {
        std::vector<double> v(b.rank() == 1 ? 9 : 8);
        try {
            b.all_gather(std::span<double>(v));
        } catch (const gradsync::CollectiveError& e) {
            sizes[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& m : sizes) {
        CAPTURE(m);
        CHECK(m.find("rank 1 is in all_gather #1 of 9 x float64 (72 B)") != std::string::npos);
    }

    gradsync::spawn(2, [&](LocalBackend& b) {
        std::int32_t counters[4] = {};
        CHECK_THROWS_WITH_AS(b.reduce_scatter(gradsync::Buffer{counters, 4, gradsync::DType::int32}, ReduceOp::sum),
                             doctest::Contains("LocalBackend reduces floating-point types only, not int32"),
                             gradsync::CollectiveError);
    });
}

TEST_CASE("a rank that never enters the reduce_scatter makes the others time out, naming it") {
    gradsync::LocalGroupOptions opts;
    opts.timeout = std::chrono::milliseconds(200);
    std::vector<std::string> messages(2);
    gradsync::spawn(
        2,
        [&](LocalBackend& b) {
            std::vector<float> v(64);
            if (b.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1200));
            try {
                b.reduce_scatter(gradsync::buffer_of(std::span<float>(v)), ReduceOp::sum,
                                 gradsync::CollectiveTag{.step = 3, .bucket = 1});
            } catch (const gradsync::CollectiveError& e) {
                messages[static_cast<std::size_t>(b.rank())] = e.what();
            }
        },
        opts);
    CAPTURE(messages[0]);
    CHECK(messages[0].find("reduce_scatter #1 of 64 x float32 (256 B), sum (step 3, bucket 1): timed out after 200 ms "
                           "waiting for rank 1") != std::string::npos);
}

TEST_CASE("LocalBackend reduce_scatter and all_gather over segments cut differently on every rank") {
    static_assert(gradsync::ScatteredShardedCollectives<LocalBackend>);
    const std::size_t n = 10'007;
    const auto want = sharded::reduced<float>(3, n, 5, ReduceOp::average);
    gradsync::spawn(3, [&](LocalBackend& b) {
        auto v = sharded::input_of<float>(b.rank(), n, 5);
        // Rank r cuts its buffer every 97 * (r + 1) elements, with an empty segment at each cut.
        std::vector<gradsync::Segment> segments;
        const std::size_t step = 97 * static_cast<std::size_t>(b.rank() + 1);
        for (std::size_t at = 0; at < n; at += step) {
            segments.push_back({v.data() + at, std::min(step, n - at)});
            segments.push_back({v.data() + at, 0});
        }
        b.reduce_scatter_async(segments, gradsync::DType::float32, ReduceOp::average).wait();
        const auto mine = shard_of(n, 3, b.rank());
        CHECK(std::memcmp(v.data() + mine.offset, want.data() + mine.offset, mine.count * sizeof(float)) == 0);
        b.all_gather(segments, gradsync::DType::float32);
        CHECK(std::memcmp(v.data(), want.data(), n * sizeof(float)) == 0);
    });
}

// Each rank's shard (reduce_scatter) and what each rank receives (all_gather) come in pieces that
// any rank may take once its own are done. With every rank's thread on one core, a rank runs
// through its time slice while the others wait for the core, and takes their pieces too; the
// bits must not depend on who took what.
TEST_CASE("reduce_scatter and all_gather pieces taken by whichever rank runs: bitwise, ranks on one core") {
    const std::size_t n = (std::size_t{3} << 20) + 7;  // pieces of 64 Ki elements, a short one in each shard
    for (int world : {2, 4}) {
        CAPTURE(world);
        const auto want = sharded::reduced<float>(world, n, 11, ReduceOp::average);
        gradsync::spawn(world, [&](LocalBackend& b) {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(0, &one);
            REQUIRE(pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0);
            for (int round = 0; round < 3; ++round) {
                auto v = sharded::input_of<float>(b.rank(), n, 11);
                b.reduce_scatter(std::span<float>(v), ReduceOp::average);
                const auto mine = shard_of(n, world, b.rank());
                CHECK(std::memcmp(v.data() + mine.offset, want.data() + mine.offset, mine.count * sizeof(float)) == 0);
                b.all_gather(std::span<float>(v));
                CHECK(std::memcmp(v.data(), want.data(), n * sizeof(float)) == 0);
            }
        });
    }
}
