// The Backend concept is the whole contract DataParallel relies on: a backend with nothing but
// its members, whose handles have nothing but Waitable's, drives DataParallel through every path
// a plain backend takes (bucketing, overlap with backward, synchronize, step) and gives what
// LocalBackend gives. Backend and ShardedCollectives are ShardedDataParallel's, likewise.
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "support/toy_model.hpp"

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

// Three steps of rank-dependent gradients, made ready in backward's order; each rank's final
// gradients and weights.
template <class Wrap>
std::vector<std::vector<float>> train(int n, Wrap wrap) {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
    gradsync::spawn(n, [&](gradsync::LocalBackend& local) {
        decltype(auto) backend = wrap(local);
        testing_support::Toy model({300, 5, 4000}, 1.0f);
        gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{4096}});
        for (int step = 0; step < 3; ++step) {
            for (std::size_t i = model.tensors.size(); i-- > 0;) {
                auto& g = model.tensors[i].g;
                for (std::size_t k = 0; k < g.size(); ++k) g[k] = float((k + i) % 7) + float(local.rank() * (step + 1));
                dp.grad_ready(i);
            }
            dp.step([&] {
                for (auto& t : model.tensors)
                    for (std::size_t k = 0; k < t.w.size(); ++k) t.w[k] -= 0.125f * t.g[k];
            });
        }
        auto& mine = out[std::size_t(local.rank())];
        for (auto& t : model.tensors) mine.insert(mine.end(), t.w.begin(), t.w.end());
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

// Three sharded steps of rank-dependent gradients, overlapped with "backward" on every rank; each
// rank's final weights.
template <class Wrap>
std::vector<std::vector<float>> train_sharded(int n, Wrap wrap) {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
    gradsync::spawn(n, [&](gradsync::LocalBackend& local) {
        decltype(auto) backend = wrap(local);
        testing_support::Toy model({300, 5, 4000}, 1.0f);
        gradsync::ShardedDataParallel sdp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{4096}});
        for (int step = 0; step < 3; ++step) {
            for (std::size_t i = model.tensors.size(); i-- > 0;) {
                auto& g = model.tensors[i].g;
                for (std::size_t k = 0; k < g.size(); ++k) g[k] = float((k + i) % 7) + float(local.rank() * (step + 1));
                sdp.grad_ready(i);
            }
            CHECK(sdp.step([](std::span<const gradsync::ShardPiece<float>> pieces) {
                         for (const auto& piece : pieces)
                             for (std::size_t k = 0; k < piece.params.size(); ++k)
                                 piece.params[k] -= 0.125f * piece.grads[k];
                     })
                      .applied);
        }
        auto& mine = out[std::size_t(local.rank())];
        for (auto& t : model.tensors) mine.insert(mine.end(), t.w.begin(), t.w.end());
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
