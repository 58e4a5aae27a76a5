// The pieces of a share are each taken exactly once, however many ranks take them at once: the
// owner in order from the front, its peers from the back.
#include <gradsync/backend/detail/piece_claims.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

using gradsync::detail::PieceClaims;

TEST_CASE("pieces come from the front to the owner and from the back to its peers, until none is left") {
    PieceClaims share;
    share.reset(3, 8);
    CHECK(share.take(PieceClaims::End::front) == 3u);
    CHECK(share.take(PieceClaims::End::back) == 7u);
    CHECK(share.take(PieceClaims::End::front) == 4u);
    CHECK(share.take(PieceClaims::End::back) == 6u);
    CHECK(share.take(PieceClaims::End::back) == 5u);
    CHECK_FALSE(share.take(PieceClaims::End::front).has_value());
    CHECK_FALSE(share.take(PieceClaims::End::back).has_value());

    share.reset(2, 2);  // an empty share, as a rank gets when there are fewer pieces than ranks
    CHECK_FALSE(share.take(PieceClaims::End::front).has_value());
    share.reset(0, 1);  // reusable for the next collective
    CHECK(share.take(PieceClaims::End::back) == 0u);
}

TEST_CASE("an owner and three peers taking at once take every piece exactly once") {
    constexpr std::size_t pieces = 200'000;
    for (int round = 0; round < 3; ++round) {
        PieceClaims share;
        share.reset(0, pieces);
        std::vector<std::vector<std::size_t>> taken(4);
        std::vector<std::thread> threads;
        for (std::size_t t = 0; t < taken.size(); ++t)
            threads.emplace_back([&, t] {
                const auto end = t == 0 ? PieceClaims::End::front : PieceClaims::End::back;
                while (const auto piece = share.take(end)) taken[t].push_back(*piece);
            });
        for (auto& t : threads) t.join();

        // The owner's pieces rise, each peer's fall: each walks its end of the share in order.
        CHECK(std::is_sorted(taken[0].begin(), taken[0].end()));
        for (std::size_t t = 1; t < taken.size(); ++t) CHECK(std::is_sorted(taken[t].rbegin(), taken[t].rend()));
        std::vector<std::size_t> all;
        for (const auto& list : taken) all.insert(all.end(), list.begin(), list.end());
        std::sort(all.begin(), all.end());
        REQUIRE(all.size() == pieces);
        CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
        CHECK(all.front() == 0u);
        CHECK(all.back() == pieces - 1);
    }
}
