// Readiness, the part of DataParallel that tracks which gradients are final: buckets go in plan
// order whatever order gradients arrive in, a second grad_ready is caught, no_sync() only notes
// use, synchronize() completes the rest, and many threads may report at once.
#include <gradsync/data_parallel/readiness.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

using gradsync::detail::Readiness;

namespace {

// Three buckets over four parameters: {3, 2}, {1}, {0}, as a reverse-order plan makes them.
gradsync::BucketPlan three_buckets() {
    gradsync::BucketPlan plan;
    plan.buckets = {{gradsync::DType::float32, {3, 2}, 20},
                    {gradsync::DType::float32, {1}, 10},
                    {gradsync::DType::float32, {0}, 10}};
    return plan;
}

}  // namespace

TEST_CASE("readiness: buckets go in plan order, whatever order their gradients arrive in") {
    Readiness r;
    r.plan(three_buckets(), 4);
    std::vector<std::size_t> launched;
    const auto launch = [&](std::size_t b) { launched.push_back(b); };
    CHECK(r.mark(1, launch) == Readiness::Mark::accepted);  // completes bucket 1, which waits for bucket 0
    CHECK(launched.empty());
    CHECK(r.any_ready());
    CHECK(r.phase() == Readiness::Phase::backward);
    CHECK(r.mark(3, launch) == Readiness::Mark::accepted);
    CHECK(launched.empty());
    CHECK(r.mark(2, launch) == Readiness::Mark::accepted);  // bucket 0 complete: 0 and 1 go
    CHECK(launched == std::vector<std::size_t>{0, 1});
    CHECK(r.launched() == 2);
    CHECK(r.mark(0, launch) == Readiness::Mark::accepted);
    CHECK(launched == std::vector<std::size_t>{0, 1, 2});
    CHECK(r.completed_at(1) <= r.completed_at(0));  // bucket 1 was complete first
    CHECK(r.ready(0));
    CHECK(r.bucket_of(2) == 0);
}

TEST_CASE("readiness: a second grad_ready in one step is reported, and reset() starts the next step") {
    Readiness r;
    r.plan(three_buckets(), 4);
    const auto launch = [](std::size_t) {};
    CHECK(r.mark(0, launch) == Readiness::Mark::accepted);
    CHECK(r.mark(0, launch) == Readiness::Mark::twice);
    r.reset();
    CHECK_FALSE(r.any_ready());
    CHECK_FALSE(r.ready(0));
    CHECK(r.launched() == 0);
    CHECK(r.mark(0, launch) == Readiness::Mark::accepted);
}

TEST_CASE("readiness: under no_sync() gradients only accumulate, and complete() counts them ready, or asks") {
    Readiness r;
    r.plan(three_buckets(), 4);
    std::vector<std::size_t> launched;
    const auto launch = [&](std::size_t b) { launched.push_back(b); };
    {
        Readiness::NoSyncGuard guard(r);
        CHECK(r.accumulating());
        for (std::size_t p : {3u, 2u, 1u}) CHECK(r.mark(p, launch) == Readiness::Mark::accumulated);
        CHECK(launched.empty());
        CHECK_FALSE(r.any_ready());
    }
    CHECK_FALSE(r.accumulating());
    // Parameter 0 was not used: the callback decides. Declined, it is missing; accepted, zero.
    std::vector<std::size_t> asked;
    auto missing = r.complete(launch, [&](std::size_t p) {
        asked.push_back(p);
        return false;
    });
    CHECK(missing == std::vector<std::size_t>{0});
    CHECK(asked == std::vector<std::size_t>{0});
    CHECK(launched == std::vector<std::size_t>{0, 1});  // the used ones went; bucket 2 still waits
    r.reset();
    launched.clear();
    missing = r.complete(launch, [](std::size_t) { return true; });
    CHECK(missing.empty());
    CHECK(launched == std::vector<std::size_t>{0, 1, 2});
}

TEST_CASE("readiness: the order gradients arrived in is recorded until the rebuild") {
    Readiness r;
    r.plan(three_buckets(), 4);
    r.record_arrivals();
    const auto launch = [](std::size_t) {};
    for (std::size_t p : {2u, 0u, 3u, 1u}) (void)r.mark(p, launch);
    CHECK(r.arrivals() == std::vector<std::size_t>{2, 0, 3, 1});
    r.stop_recording();
    CHECK(r.recording_capacity() == 0);
    r.reset();
    (void)r.mark(1, launch);
    CHECK(r.arrivals().empty());
}

TEST_CASE("readiness: grad_ready from many threads launches every bucket once, in plan order") {
    gradsync::BucketPlan plan;
    constexpr std::size_t params = 64;
    for (std::size_t b = 0; b < params / 4; ++b)
        plan.buckets.push_back({gradsync::DType::float32, {4 * b, 4 * b + 1, 4 * b + 2, 4 * b + 3}, 4});
    Readiness r;
    r.plan(plan, params);
    for (int round = 0; round < 20; ++round) {
        std::mutex mutex;
        std::vector<std::size_t> launched;
        std::atomic<int> twice{0};
        std::vector<std::thread> threads;
        for (std::size_t t = 0; t < 4; ++t)
            threads.emplace_back([&, t] {
                for (std::size_t p = t; p < params; p += 4)
                    if (r.mark(params - 1 - p, [&](std::size_t b) {
                            std::lock_guard lock(mutex);
                            launched.push_back(b);
                        }) == Readiness::Mark::twice)
                        ++twice;
            });
        for (auto& t : threads) t.join();
        CHECK(twice.load() == 0);
        std::vector<std::size_t> in_order(plan.buckets.size());
        for (std::size_t b = 0; b < in_order.size(); ++b) in_order[b] = b;
        CHECK(launched == in_order);
        r.reset();
    }
}
