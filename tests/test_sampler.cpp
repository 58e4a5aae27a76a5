// ShardedSampler: disjoint shards of equal length, the same shuffle on every rank, per epoch.
#include <gradsync/launch/sampler.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

using gradsync::SamplerTail;
using gradsync::ShardedSampler;

namespace {

std::vector<std::vector<std::size_t>> shards(std::size_t n, int world, ShardedSampler::Options o, std::uint64_t epoch) {
    std::vector<std::vector<std::size_t>> out;
    for (int r = 0; r < world; ++r) {
        ShardedSampler s(n, world, r, o);
        s.set_epoch(epoch);
        out.push_back(s.indices());
    }
    return out;
}

}  // namespace

TEST_CASE("shards cover the dataset, disjointly with drop, every example at least once with pad") {
    for (std::size_t n : {0u, 1u, 2u, 3u, 7u, 10u, 64u, 1001u}) {
        for (int world : {1, 2, 3, 4, 8}) {
            for (auto tail : {SamplerTail::pad, SamplerTail::drop}) {
                CAPTURE(n);
                CAPTURE(world);
                CAPTURE(static_cast<int>(tail));
                auto all = shards(n, world, {.seed = 42, .shuffle = true, .tail = tail}, 3);
                const std::size_t each = all[0].size();
                std::map<std::size_t, int> seen;
                for (const auto& shard : all) {
                    CHECK(shard.size() == each);  // the same number on every rank
                    for (auto i : shard) {
                        CHECK(i < n);
                        ++seen[i];
                    }
                }
                if (tail == SamplerTail::drop) {
                    CHECK(each == n / static_cast<std::size_t>(world));
                    for (const auto& [i, times] : seen) CHECK(times == 1);
                } else {
                    CHECK(each == (n + static_cast<std::size_t>(world) - 1) / static_cast<std::size_t>(world));
                    CHECK(seen.size() == n);  // size < world included: indices repeat, none is missing
                }
            }
        }
    }
}

TEST_CASE("the shuffle is a function of seed and epoch, the same on every rank") {
    auto a = shards(100, 4, {.seed = 7}, 0);
    auto b = shards(100, 4, {.seed = 7}, 0);
    auto next = shards(100, 4, {.seed = 7}, 1);
    auto other = shards(100, 4, {.seed = 8}, 0);
    CHECK(a == b);
    CHECK(a != next);
    CHECK(a != other);
    auto plain = shards(10, 2, {.shuffle = false}, 5);
    CHECK(plain[0] == std::vector<std::size_t>{0, 2, 4, 6, 8});
    CHECK(plain[1] == std::vector<std::size_t>{1, 3, 5, 7, 9});
    // A fixed expectation, so that the order cannot drift between versions or platforms.
    auto pinned = shards(6, 2, {.seed = 1}, 0);
    CHECK(pinned[0] == std::vector<std::size_t>{5, 4, 0});
    CHECK(pinned[1] == std::vector<std::size_t>{2, 3, 1});
}

TEST_CASE("batch counts are equal across ranks, and bad arguments are errors") {
    ShardedSampler s(10, 3, 2);
    CHECK(s.size() == 4);
    CHECK(s.batches(3) == 2);
    CHECK(s.batches(3, /*drop_last=*/true) == 1);
    CHECK_THROWS_AS((void)s.batches(0), gradsync::Error);
    CHECK_THROWS_WITH_AS(ShardedSampler(10, 2, 2), doctest::Contains("0 <= rank < world size, got rank 2 of 2"),
                         gradsync::Error);
}
