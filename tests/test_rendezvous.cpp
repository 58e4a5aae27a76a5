// detail::Rendezvous, the host half of the device LocalBackend: every rank sees every rank's call
// of the same round, round after round; a rank that does not come ends the wait at the deadline,
// naming it; an abort ends every wait with its reason.
#include <gradsync/backend/detail/rendezvous.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

TEST_CASE("rendezvous: every rank sees every rank's call of the same round, for many rounds") {
    constexpr int ranks = 4, rounds = 300;
    gradsync::detail::Rendezvous<int> meet(ranks, 10s);
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
            for (int k = 0; k < rounds; ++k) {
                const auto calls = meet.arrive(r, k * 100 + r, "rank " + std::to_string(r), "round");
                for (int q = 0; q < ranks; ++q) wrong += calls[std::size_t(q)] != k * 100 + q;
            }
        });
    }
    for (auto& t : threads) t.join();
    CHECK(wrong.load() == 0);
    CHECK_FALSE(meet.failed());
}

TEST_CASE("rendezvous: a rank that never comes ends the others' wait at the deadline, naming it") {
    gradsync::detail::Rendezvous<int> meet(3, 50ms);
    std::string errors[2];
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
        threads.emplace_back([&, r] {
            try {
                meet.arrive(r, r, "gradsync: rank " + std::to_string(r) + " of 3", "allreduce #1");
            } catch (const gradsync::TimeoutError& e) {
                errors[r] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    // The first to time out fails the group; the other gets the same reason.
    CHECK(errors[0] == errors[1]);
    CHECK(errors[0].find(": allreduce #1 waited 50 ms for rank 2, which did not reach it; the group was aborted") !=
          std::string::npos);
    CHECK_THROWS_AS(meet.arrive(2, 2, "rank 2", "allreduce #1"), gradsync::TimeoutError);  // too late
}

TEST_CASE("rendezvous: an abort ends every wait with its reason") {
    gradsync::detail::Rendezvous<int> meet(2, 10s);
    std::string error;
    std::thread waiter([&] {
        try {
            meet.arrive(0, 0, "rank 0", "barrier");
        } catch (const gradsync::CollectiveError& e) {
            error = e.what();
        }
    });
    std::this_thread::sleep_for(10ms);
    meet.abort("gradsync: rank 1 threw: out of memory");
    waiter.join();
    CHECK(error == "gradsync: rank 1 threw: out of memory");
    CHECK_THROWS_WITH_AS(meet.throw_if_failed(), "gradsync: rank 1 threw: out of memory", gradsync::CollectiveError);
}
