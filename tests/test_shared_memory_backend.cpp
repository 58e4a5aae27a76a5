// SharedMemoryBackend: the ranks of one machine through a shared-memory object. Ranks run as
// threads (each maps the object itself, at its own address, as a process does) and as forked
// processes; results are compared bitwise with LocalBackend's on the same inputs.
#include <gradsync/backend/local.hpp>
#include <gradsync/backend/shared_memory.hpp>
#include <gradsync/backend/two_level.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "support/toy_training.hpp"

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

using gradsync::SharedMemoryBackend;
using gradsync::SharedMemoryOptions;

std::string unique_name() {
    static std::atomic<int> next{0};
    return "/gradsync-test-" + std::to_string(::getpid()) + "-" + std::to_string(next++);
}

// Runs body(backend) for every rank on its own thread, each with its own backend; rethrows the
// first rank's exception.
void run_threads(int n, const std::string& name, SharedMemoryOptions options,
                 const std::function<void(SharedMemoryBackend&)>& body) {
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
        threads.emplace_back([&, r] {
            try {
                SharedMemoryBackend b(name, r, n, options);
                body(b);
            } catch (...) {
                errors[std::size_t(r)] = std::current_exception();
            }
        });
    for (auto& t : threads) t.join();
    for (auto& e : errors)
        if (e) std::rethrow_exception(e);
}

// Rank-dependent values, awkward for rounding.
template <class T>
std::vector<T> rank_values(std::size_t count, int rank) {
    std::vector<T> v(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = T(float(i % 97) * 0.37f + float(rank) * 1.13f + 0.01f);
    return v;
}

// Every rank's buffer after allreduce(op) through the backend a runner builds.
template <class T, class Runner>
std::vector<std::vector<T>> reduce_with(int n, std::size_t count, gradsync::ReduceOp op, Runner runner) {
    std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
    runner([&](auto& b) {
        auto v = rank_values<T>(count, b.rank());
        b.allreduce(std::span<T>(v), op);
        out[std::size_t(b.rank())] = std::move(v);
    });
    return out;
}

template <class T>
void check_matches_local(int n, std::size_t count, gradsync::ReduceOp op, SharedMemoryOptions options) {
    CAPTURE(n);
    CAPTURE(count);
    auto local = reduce_with<T>(n, count, op, [&](auto body) { gradsync::spawn(n, body); });
    auto shared = reduce_with<T>(n, count, op, [&](auto body) {
        run_threads(n, unique_name(), options, [&](SharedMemoryBackend& b) { body(b); });
    });
    for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        REQUIRE(shared[std::size_t(r)].size() == count);
        if (count != 0) CHECK(std::memcmp(shared[std::size_t(r)].data(), local[0].data(), count * sizeof(T)) == 0);
    }
}

}  // namespace

TEST_CASE("SharedMemoryBackend: allreduce is bitwise LocalBackend's, every float type, inside and across slots") {
    const SharedMemoryOptions small{.slot = gradsync::Bytes{4096}};  // 1024 floats a chunk
    for (int n : {1, 2, 3, 4})
        for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{1024}, std::size_t{1025},
                                  std::size_t{10'007}}) {
            check_matches_local<float>(n, count, gradsync::ReduceOp::sum, small);
            check_matches_local<float>(n, count, gradsync::ReduceOp::average, small);
        }
    check_matches_local<double>(3, 3001, gradsync::ReduceOp::average, small);
    check_matches_local<gradsync::bfloat16>(3, 5003, gradsync::ReduceOp::sum, small);
    check_matches_local<gradsync::float16>(2, 5003, gradsync::ReduceOp::average, small);
    check_matches_local<float>(2, 1'000'003, gradsync::ReduceOp::sum, {});  // default slots, several chunks
}

TEST_CASE("SharedMemoryBackend: a scattered allreduce reduces the segments where they lie, as one buffer") {
    const SharedMemoryOptions small{.slot = gradsync::Bytes{4096}};
    run_threads(3, unique_name(), small, [](SharedMemoryBackend& b) {
        auto flat = rank_values<float>(5000, b.rank());
        std::vector<float> a(flat.begin(), flat.begin() + 7), c(flat.begin() + 7, flat.begin() + 3001),
            d(flat.begin() + 3001, flat.end());
        const std::vector<gradsync::Segment> segs{
            {a.data(), a.size()}, {c.data(), 0}, {c.data(), c.size()}, {d.data(), d.size()}};
        auto handle = b.allreduce_async(segs, gradsync::DType::float32, gradsync::ReduceOp::average);
        b.allreduce(std::span<float>(flat), gradsync::ReduceOp::average);  // runs after the launched one
        handle.wait();
        std::vector<float> joined(a);
        joined.insert(joined.end(), c.begin(), c.end());
        joined.insert(joined.end(), d.begin(), d.end());
        CHECK(std::memcmp(joined.data(), flat.data(), flat.size() * sizeof(float)) == 0);
    });
}

// Every rank's buffer after reduce_scatter then (on a copy) all_gather, contiguous or cut in
// segments, through the backend a runner builds: the shard of the first, the whole of the second.
template <class Runner>
std::vector<std::vector<float>> shard_with(int n, std::size_t count, bool cut, Runner runner) {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
    runner([&](auto& b) {
        auto v = rank_values<float>(count, b.rank());
        auto g = rank_values<float>(count, b.rank() + 10);
        const std::size_t half = count / 3;
        const std::vector<gradsync::Segment> vs{{v.data(), half}, {v.data() + half, count - half}},
            gs{{g.data(), half}, {g.data() + half, count - half}};
        if (cut) {
            b.reduce_scatter_async(vs, gradsync::DType::float32, gradsync::ReduceOp::average).wait();
            b.all_gather(gs, gradsync::DType::float32);
        } else {
            b.reduce_scatter(std::span<float>(v), gradsync::ReduceOp::average);
            b.all_gather_async(std::span<float>(g)).wait();
        }
        const auto mine = gradsync::shard_of(count, b.size(), b.rank());
        auto& o = out[std::size_t(b.rank())];
        o.assign(v.begin() + std::ptrdiff_t(mine.offset), v.begin() + std::ptrdiff_t(mine.offset + mine.count));
        o.insert(o.end(), g.begin(), g.end());
    });
    return out;
}

TEST_CASE("SharedMemoryBackend: reduce_scatter and all_gather are bitwise LocalBackend's, in one buffer or segments") {
    const SharedMemoryOptions small{.slot = gradsync::Bytes{4096}};
    for (int n : {1, 2, 3})
        for (std::size_t count : {std::size_t{2}, std::size_t{1000}, std::size_t{5003}})
            for (bool cut : {false, true}) {
                CAPTURE(n);
                CAPTURE(count);
                CAPTURE(cut);
                const auto local = shard_with(n, count, cut, [&](auto body) { gradsync::spawn(n, body); });
                const auto shared = shard_with(n, count, cut, [&](auto body) {
                    run_threads(n, unique_name(), small, [&](SharedMemoryBackend& b) { body(b); });
                });
                CHECK(shared == local);
            }
}

TEST_CASE("SharedMemoryBackend as the node level of TwoLevelBackend: 2 nodes x 2 ranks sum as one group") {
    // Node k's ranks share "/...-node-k"; the ranks in one place across the nodes are a LocalBackend group.
    const std::string prefix = unique_name();
    std::vector<int> place_of{0, 1, 0, 1};
    auto across = gradsync::LocalBackend::split(place_of);
    std::vector<std::vector<float>> out(4);
    gradsync::spawn(4, [&](gradsync::LocalBackend& job) {
        const int r = job.rank();
        SharedMemoryBackend node(prefix + "-node-" + std::to_string(r / 2), r % 2, 2, {.slot = gradsync::Bytes{4096}});
        gradsync::TwoLevelBackend<SharedMemoryBackend, gradsync::LocalBackend> backend(node, across[std::size_t(r)]);
        auto v = rank_values<float>(3001, backend.rank());
        backend.allreduce(std::span<float>(v));
        out[std::size_t(r)] = v;
    });
    for (std::size_t i = 0; i < 3001; ++i) {
        // Each node's sum first, then the nodes': (r0 + r1) + (r2 + r3).
        const float want = (rank_values<float>(3001, 0)[i] + rank_values<float>(3001, 1)[i]) +
                           (rank_values<float>(3001, 2)[i] + rank_values<float>(3001, 3)[i]);
        for (const auto& o : out) REQUIRE(o[i] == want);
    }
}

TEST_CASE("SharedMemoryBackend: broadcast copies the root's bytes across slots, and a barrier waits for every rank") {
    const SharedMemoryOptions small{.slot = gradsync::Bytes{4096}};
    std::atomic<int> arrived{0};
    run_threads(3, unique_name(), small, [&](SharedMemoryBackend& b) {
        std::vector<std::byte> bytes(9000);
        for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte((i * 7 + unsigned(b.rank())) & 0xff);
        b.broadcast(std::span<std::byte>(bytes), 1);
        for (std::size_t i = 0; i < bytes.size(); ++i) REQUIRE(bytes[i] == std::byte((i * 7 + 1) & 0xff));
        if (b.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        arrived.fetch_add(1);
        b.barrier();
        CHECK(arrived.load() == 3);
    });
}

TEST_CASE("SharedMemoryBackend: ranks in separate processes reduce together") {
    const auto name = unique_name();
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        int status = 1;
        try {
            SharedMemoryBackend b(name, 1, 2, {.slot = gradsync::Bytes{4096}});
            auto v = rank_values<float>(10'000, 1);
            b.allreduce(std::span<float>(v), gradsync::ReduceOp::sum);
            const auto want = rank_values<float>(10'000, 0);
            status = v[9999] == want[9999] + rank_values<float>(10'000, 1)[9999] ? 0 : 2;
        } catch (...) {
            status = 3;
        }
        ::_exit(status);
    }
    SharedMemoryBackend b(name, 0, 2, {.slot = gradsync::Bytes{4096}});
    auto v = rank_values<float>(10'000, 0);
    b.allreduce(std::span<float>(v), gradsync::ReduceOp::sum);
    const auto mine = rank_values<float>(10'000, 0), theirs = rank_values<float>(10'000, 1);
    for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(v[i] == mine[i] + theirs[i]);
    int status = -1;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    CHECK(::shm_open(name.c_str(), O_RDWR, 0600) == -1);  // the name was removed once both had mapped it
}

TEST_CASE("SharedMemoryBackend: a peer process that exits is named at once, long before the deadline") {
    const auto name = unique_name();
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        SharedMemoryBackend b(name, 1, 2);
        ::_exit(0);  // dies holding its backend: no destructor runs
    }
    SharedMemoryBackend b(name, 0, 2, {.timeout = std::chrono::seconds(60)});
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    std::vector<float> v(100, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(b.allreduce(std::span<float>(v)), doctest::Contains("rank 1 (process"),
                         gradsync::CollectiveError);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
    CHECK_THROWS_WITH_AS(b.barrier(), doctest::Contains("the group was aborted"), gradsync::CollectiveError);
}

TEST_CASE("SharedMemoryBackend: a rank that leaves, one that never calls, and calls that differ all fail every rank") {
    SUBCASE("left") {
        const auto name = unique_name();
        std::thread peer([&] { SharedMemoryBackend b(name, 1, 2); });
        SharedMemoryBackend b(name, 0, 2);
        peer.join();
        std::vector<float> v(10, 1.0f);
        CHECK_THROWS_WITH_AS(b.allreduce(std::span<float>(v)), doctest::Contains("rank 1 left the group"),
                             gradsync::CollectiveError);
    }
    SUBCASE("never calls: the deadline, then the group is aborted for the late rank too") {
        const auto name = unique_name();
        std::atomic<bool> failed{false};
        std::thread peer([&] {
            SharedMemoryBackend b(name, 1, 2);
            while (!failed.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            std::vector<float> v(10, 1.0f);
            CHECK_THROWS_WITH_AS(b.allreduce(std::span<float>(v)), doctest::Contains("did not arrive within"),
                                 gradsync::CollectiveError);
        });
        SharedMemoryBackend b(name, 0, 2, {.timeout = std::chrono::milliseconds(200)});
        std::vector<float> v(10, 1.0f);
        CHECK_THROWS_WITH_AS(b.allreduce(std::span<float>(v)), doctest::Contains("rank 1 did not arrive within"),
                             gradsync::TimeoutError);
        failed = true;
        peer.join();
    }
    SUBCASE("calls that differ") {
        run_threads(2, unique_name(), {}, [](SharedMemoryBackend& b) {
            std::vector<float> v(b.rank() == 0 ? 10 : 12, 1.0f);
            CHECK_THROWS_WITH_AS(b.allreduce(std::span<float>(v)),
                                 doctest::Contains("collective mismatch: rank 0 is in allreduce #1 of 10 x float32"),
                                 gradsync::CollectiveError);
        });
    }
}

TEST_CASE("SharedMemoryBackend: bad arguments, a name in use and ranks that disagree on the group are refused") {
    CHECK_THROWS_WITH_AS(SharedMemoryBackend("no-slash", 0, 1), doctest::Contains("the name must be"), gradsync::Error);
    CHECK_THROWS_WITH_AS(SharedMemoryBackend("/a", 2, 2), doctest::Contains("rank 2 is not in a group of 2"),
                         gradsync::Error);
    CHECK_THROWS_WITH_AS(SharedMemoryBackend("/a", 0, 1, {.slot = gradsync::Bytes{100}}),
                         doctest::Contains("multiple of 64 bytes"), gradsync::Error);

    const auto taken = unique_name();
    const int fd = ::shm_open(taken.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    REQUIRE(fd >= 0);
    CHECK_THROWS_WITH_AS(SharedMemoryBackend(taken, 0, 1), doctest::Contains(("remove /dev/shm" + taken).c_str()),
                         gradsync::CollectiveError);
    ::close(fd);
    ::shm_unlink(taken.c_str());

    const auto name = unique_name();
    std::thread creator([&] {
        CHECK_THROWS_AS(SharedMemoryBackend(name, 0, 2, {.timeout = std::chrono::milliseconds(300)}),
                        gradsync::TimeoutError);
    });
    CHECK_THROWS_WITH_AS(SharedMemoryBackend(name, 1, 3, {.timeout = std::chrono::milliseconds(300)}),
                         doctest::Contains("belongs to a group of 2 ranks"), gradsync::CollectiveError);
    creator.join();
}

TEST_CASE("ShardedDataParallel over SharedMemoryBackend steps as over LocalBackend, bit for bit") {
    auto train = [](gradsync::Backend auto& backend) { return testing_support::train_toy_sharded(backend); };
    std::vector<std::vector<float>> local(3), shared(3);
    gradsync::spawn(3, [&](gradsync::LocalBackend& b) { local[std::size_t(b.rank())] = train(b); });
    run_threads(3, unique_name(), {.slot = gradsync::Bytes{8192}},
                [&](SharedMemoryBackend& b) { shared[std::size_t(b.rank())] = train(b); });
    for (int r = 0; r < 3; ++r) CHECK(shared[std::size_t(r)] == local[0]);
}

TEST_CASE("DataParallel over SharedMemoryBackend trains as over LocalBackend, bit for bit") {
    auto train = [](gradsync::Backend auto& backend) { return testing_support::train_toy(backend); };
    for (int n : {2, 3}) {
        CAPTURE(n);
        const auto ranks = static_cast<std::size_t>(n);
        std::vector<std::vector<float>> local(ranks), shared(ranks);
        gradsync::spawn(n, [&](gradsync::LocalBackend& b) { local[std::size_t(b.rank())] = train(b); });
        run_threads(n, unique_name(), {.slot = gradsync::Bytes{8192}},
                    [&](SharedMemoryBackend& b) { shared[std::size_t(b.rank())] = train(b); });
        for (int r = 0; r < n; ++r) CHECK(shared[std::size_t(r)] == local[0]);
    }
}
