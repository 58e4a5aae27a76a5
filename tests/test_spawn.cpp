// spawn: one thread per rank, joined, and the first exception rethrown once all are released.
#include <gradsync/launch/spawn.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

TEST_CASE("spawn runs every rank once, each on its own thread") {
    for (int n : {1, 2, 5, 8}) {
        std::mutex m;
        std::multiset<int> ranks;
        std::set<std::thread::id> threads;
        gradsync::spawn(n, [&](gradsync::LocalBackend& b) {
            std::lock_guard lock(m);
            ranks.insert(b.rank());
            threads.insert(std::this_thread::get_id());
            CHECK(b.size() == n);
        });
        CHECK(ranks.size() == static_cast<std::size_t>(n));
        for (int r = 0; r < n; ++r) CHECK(ranks.count(r) == 1);
        CHECK(threads.size() == static_cast<std::size_t>(n));
        CHECK(threads.count(std::this_thread::get_id()) == 0);
    }
}

TEST_CASE("spawn rethrows the cause, not the failures it caused") {
    std::atomic<int> released{0};
    auto start = std::chrono::steady_clock::now();
    try {
        gradsync::spawn(3, [&](gradsync::LocalBackend& b) {
            if (b.rank() == 1) {
                std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others are blocked by now
                throw std::logic_error("bad batch on rank 1");
            }
            try {
                b.barrier();
            } catch (const gradsync::CollectiveError&) {
                ++released;
                throw;  // the peers' own failures must not replace the cause
            }
        });
        FAIL("spawn did not throw");
    } catch (const std::logic_error& e) {
        CHECK(std::string(e.what()) == "bad batch on rank 1");
    }
    CHECK(released.load() == 2);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
}

TEST_CASE("spawn passes group options and refuses an empty group") {
    gradsync::LocalGroupOptions opts;
    opts.timeout = std::chrono::milliseconds(1234);
    gradsync::spawn(
        2, [&](gradsync::LocalBackend& b) { CHECK(b.options().timeout.count() == 1234); }, opts);
    CHECK_THROWS_AS(gradsync::spawn(0, [](gradsync::LocalBackend&) {}), gradsync::Error);
    opts.timeout = std::chrono::milliseconds(0);
    CHECK_THROWS_WITH_AS(gradsync::spawn(
                             2, [](gradsync::LocalBackend&) {}, opts),
                         doctest::Contains("timeout must be positive"), gradsync::Error);
}
