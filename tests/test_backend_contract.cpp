// The Backend concept is the whole contract DataParallel relies on: a backend with nothing but
// its members, whose handles have nothing but Waitable's, drives DataParallel through every path
// a plain backend takes (bucketing, overlap with backward, synchronize, step) and gives what
// LocalBackend gives. Backend and ShardedCollectives are ShardedDataParallel's, likewise.
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "support/toy_training.hpp"

#include <chrono>
#include <cstring>
#include <span>
#include <vector>

namespace {

// LocalBackend behind exactly what Waitable states.
class BareHandle {
public:
    explicit BareHandle(gradsync::CollectiveHandle h) : h_(std::move(h)) {}
    void wait() const { h_.wait(); }
    [[nodiscard]] bool ready() const { return h_.ready(); }
    [[nodiscard]] bool wait_until(std::chrono::steady_clock::time_point deadline) const {
        return h_.wait_until(deadline);
    }

private:
    gradsync::CollectiveHandle h_;
};

// ...and behind exactly what Backend states.
class BareBackend {
public:
    explicit BareBackend(gradsync::LocalBackend& b) : b_(b) {}
    [[nodiscard]] int rank() const { return b_.rank(); }
    [[nodiscard]] int size() const { return b_.size(); }
    [[nodiscard]] bool supports(gradsync::DType t) const { return b_.supports(t); }
    void allreduce(gradsync::Buffer buf, gradsync::ReduceOp op) { b_.allreduce(buf, op); }
    BareHandle allreduce_async(gradsync::Buffer buf, gradsync::ReduceOp op) {
        return BareHandle(b_.allreduce_async(buf, op));
    }
    void broadcast(std::span<std::byte> bytes, int root) { b_.broadcast(bytes, root); }
    void barrier() { b_.barrier(); }

private:
    gradsync::LocalBackend& b_;
};

static_assert(gradsync::Backend<BareBackend>);
static_assert(!gradsync::TaggedCollectives<BareBackend>);
static_assert(!gradsync::ScatteredAllreduce<BareBackend>);

// Each rank's final weights after three steps over `wrap(its LocalBackend)`.
template <class Wrap>
std::vector<std::vector<float>> train(int n, Wrap wrap) {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
    gradsync::spawn(n, [&](gradsync::LocalBackend& local) {
        decltype(auto) backend = wrap(local);
        out[std::size_t(local.rank())] = testing_support::train_toy(backend);
    });
    return out;
}

}  // namespace

TEST_CASE(
    "a backend with only the Backend concept's members, and handles with only Waitable's, drive "
    "DataParallel as LocalBackend does") {
    for (int n : {1, 2, 3}) {
        CAPTURE(n);
        const auto bare = train(n, [](gradsync::LocalBackend& b) { return BareBackend(b); });
        const auto local = train(n, [](gradsync::LocalBackend& b) -> gradsync::LocalBackend& { return b; });
        for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            REQUIRE(bare[std::size_t(r)].size() == local[0].size());
            CHECK(std::memcmp(bare[std::size_t(r)].data(), local[0].data(), local[0].size() * sizeof(float)) == 0);
        }
    }
}

namespace {

// ...and with exactly the collectives ShardedCollectives adds, for ShardedDataParallel.
class BareShardedBackend : public BareBackend {
public:
    explicit BareShardedBackend(gradsync::LocalBackend& b) : BareBackend(b), b_(b) {}
    void reduce_scatter(gradsync::Buffer buf, gradsync::ReduceOp op) { b_.reduce_scatter(buf, op); }
    BareHandle reduce_scatter_async(gradsync::Buffer buf, gradsync::ReduceOp op) {
        return BareHandle(b_.reduce_scatter_async(buf, op));
    }
    void all_gather(gradsync::Buffer buf) { b_.all_gather(buf); }
    BareHandle all_gather_async(gradsync::Buffer buf) { return BareHandle(b_.all_gather_async(buf)); }

private:
    gradsync::LocalBackend& b_;
};

static_assert(gradsync::ShardedCollectives<BareShardedBackend>);
static_assert(!gradsync::ScatteredShardedCollectives<BareShardedBackend>);
static_assert(!gradsync::TaggedShardedCollectives<BareShardedBackend>);

// ...and after three sharded steps, overlapped with "backward" on every rank.
template <class Wrap>
std::vector<std::vector<float>> train_sharded(int n, Wrap wrap) {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
    gradsync::spawn(n, [&](gradsync::LocalBackend& local) {
        decltype(auto) backend = wrap(local);
        out[std::size_t(local.rank())] = testing_support::train_toy_sharded(backend);
    });
    return out;
}

}  // namespace

TEST_CASE(
    "a backend with only the Backend and ShardedCollectives concepts' members, and bare handles, drive "
    "ShardedDataParallel as LocalBackend does") {
    for (int n : {1, 2, 3}) {
        CAPTURE(n);
        const auto bare = train_sharded(n, [](gradsync::LocalBackend& b) { return BareShardedBackend(b); });
        const auto local = train_sharded(n, [](gradsync::LocalBackend& b) -> gradsync::LocalBackend& { return b; });
        for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            REQUIRE(bare[std::size_t(r)].size() == local[0].size());
            CHECK(std::memcmp(bare[std::size_t(r)].data(), local[0].data(), local[0].size() * sizeof(float)) == 0);
        }
    }
}
