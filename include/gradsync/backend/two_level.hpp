// TwoLevelBackend: an allreduce that crosses the slow link between machines once. The ranks of a
// node reduce-scatter among themselves (fast: shared memory), each allreduces its share with the
// ranks in the same place on the other nodes (the only traffic between nodes: 1/(ranks per
// node) of the gradients from each rank, where a flat ring sends all of them from every rank),
// and the node all-gathers the result. Its reduce_scatter and all_gather shard inside the node and
// replicate across the nodes (the ReplicatedShards concept): ShardedDataParallel over it keeps the
// optimizer's state split among a node's ranks and the same on every node (hybrid sharding).
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/detail/async_collectives.hpp>
#include <gradsync/backend/detail/held_segments.hpp>
#include <gradsync/backend/detail/typed_calls.hpp>
#include <gradsync/backend/handle.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>  // for std::move

namespace gradsync::inline v0 {

// `Node` spans the ranks of this rank's node; `Across` the rank in this rank's place on every
// node (node.rank() equal on all of them). Every node holds the same number of ranks: the
// constructor checks both, collectively, and throws on every rank where they do not hold. The
// backend is numbered node by node: rank across.rank() * node.size() + node.rank(), as launchers
// number the ranks of a job. Both backends must outlive it and be driven only through it while it
// lives (it is their one caller, from one thread at a time, like every backend).
//
// The sums run in another order than one flat allreduce's (each node's first), so results agree
// with a flat backend's to rounding, not bit for bit; an average divides within each level,
// folded into its reduction.
template <ScatteredShardedCollectives Node, ScatteredAllreduce Across>
class TwoLevelBackend : public detail::TypedCalls<TwoLevelBackend<Node, Across>> {
    using Typed = detail::TypedCalls<TwoLevelBackend<Node, Across>>;

public:
    using Typed::all_gather;
    using Typed::all_gather_async;
    using Typed::allreduce;
    using Typed::allreduce_async;
    using Typed::broadcast;
    using Typed::reduce_scatter;
    using Typed::reduce_scatter_async;

    TwoLevelBackend(Node& node, Across& across) : node_(node), across_(across) { check_layout(); }
    TwoLevelBackend(const TwoLevelBackend&) = delete;
    TwoLevelBackend& operator=(const TwoLevelBackend&) = delete;
    ~TwoLevelBackend() { async_.stop(); }  // drains: every launched collective ends first

    [[nodiscard]] int rank() const { return across_.rank() * node_.size() + node_.rank(); }
    [[nodiscard]] int size() const { return across_.size() * node_.size(); }
    [[nodiscard]] bool supports(DType t) const { return node_.supports(t) && across_.supports(t); }
    // Shards are split among the node's ranks and replicated across the nodes: node n holds copy n.
    [[nodiscard]] int shard_ranks() const { return node_.size(); }
    [[nodiscard]] int shard_rank() const { return node_.rank(); }
    [[nodiscard]] int replica() const { return across_.rank(); }
    [[nodiscard]] Node& node() { return node_; }
    [[nodiscard]] Across& across() { return across_; }
    // Elements this rank has handed to the level between nodes so far: its shares.
    [[nodiscard]] std::uint64_t elements_across() const { return elements_across_.load(std::memory_order_relaxed); }
    // ...and elements it was asked to reduce (allreduce and reduce_scatter): a flat backend would
    // send all of them across.
    [[nodiscard]] std::uint64_t elements_reduced() const { return elements_reduced_.load(std::memory_order_relaxed); }

    void allreduce(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        const Segment seg{buf.data, buf.count};
        allreduce(std::span<const Segment>(&seg, 1), buf.dtype, op, tag);
    }
    CollectiveHandle allreduce_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        const Segment seg{buf.data, buf.count};
        return allreduce_async(std::span<const Segment>(&seg, 1), buf.dtype, op, tag);
    }
    void allreduce(std::span<const Segment> segments, DType t, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        async_.wait_for_all();
        reduce(segments, t, op, tag);
    }
    // The segment list is copied; the memory it points to must stay untouched until completion.
    CollectiveHandle allreduce_async(std::span<const Segment> segments, DType t, ReduceOp op = ReduceOp::sum,
                                     CollectiveTag tag = {}) {
        return launch([this, op, tag](std::span<const Segment> s, DType d) { reduce(s, d, op, tag); }, segments, t);
    }

    // Leaves the reduction over every rank of the job in this rank's shard of the node
    // (shard_of(count, shard_ranks(), shard_rank())): the node reduce-scatters, then the share is
    // allreduced across. The rest is unspecified.
    void reduce_scatter(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        const Segment seg{buf.data, buf.count};
        reduce_scatter(std::span<const Segment>(&seg, 1), buf.dtype, op, tag);
    }
    CollectiveHandle reduce_scatter_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        const Segment seg{buf.data, buf.count};
        return reduce_scatter_async(std::span<const Segment>(&seg, 1), buf.dtype, op, tag);
    }
    void reduce_scatter(std::span<const Segment> segments, DType t, ReduceOp op = ReduceOp::sum,
                        CollectiveTag tag = {}) {
        async_.wait_for_all();
        scatter(segments, t, op, tag);
    }
    CollectiveHandle reduce_scatter_async(std::span<const Segment> segments, DType t, ReduceOp op = ReduceOp::sum,
                                          CollectiveTag tag = {}) {
        return launch([this, op, tag](std::span<const Segment> s, DType d) { scatter(s, d, op, tag); }, segments, t);
    }
    // Copies every shard of this rank's node into the node's other ranks: every node holds the same.
    void all_gather(Buffer buf, CollectiveTag tag = {}) {
        const Segment seg{buf.data, buf.count};
        all_gather(std::span<const Segment>(&seg, 1), buf.dtype, tag);
    }
    CollectiveHandle all_gather_async(Buffer buf, CollectiveTag tag = {}) {
        const Segment seg{buf.data, buf.count};
        return all_gather_async(std::span<const Segment>(&seg, 1), buf.dtype, tag);
    }
    void all_gather(std::span<const Segment> segments, DType t, CollectiveTag tag = {}) {
        async_.wait_for_all();
        gather(segments, t, tag);
    }
    CollectiveHandle all_gather_async(std::span<const Segment> segments, DType t, CollectiveTag tag = {}) {
        return launch([this, tag](std::span<const Segment> s, DType d) { gather(s, d, tag); }, segments, t);
    }

    // From `root` of this backend's numbering: across the nodes among the ranks in root's place,
    // then within every node.
    void broadcast(std::span<std::byte> bytes, int root, CollectiveTag tag = {}) {
        if (root < 0 || root >= size())
            throw CollectiveError(detail::rank_prefix(rank()) + ": broadcast from rank " + std::to_string(root) +
                                  " of a group of " + std::to_string(size()));
        async_.wait_for_all();
        guarded([&] {
            if (node_.rank() == root % node_.size()) detail::broadcast_tagged(across_, bytes, root / node_.size(), tag);
            detail::broadcast_tagged(node_, bytes, root % node_.size(), tag);
        });
    }

    void barrier() {
        async_.wait_for_all();
        guarded([&] {
            node_.barrier();
            across_.barrier();
            node_.barrier();
        });
    }

    // Fails every pending and future collective of both levels (where both can be aborted).
    void abort(const std::string& reason) requires Abortable<Node> && Abortable<Across> {
        node_.abort(reason);
        across_.abort(reason);
    }

private:
    // Each level fails on its own; the other level's peers would wait for their deadline, so a
    // failure aborts both where they can be.
    template <class F>
    void guarded(F&& body) {
        try {
            body();
        } catch (const std::exception& e) {
            if constexpr (Abortable<Node> && Abortable<Across>) abort(e.what());
            throw;
        }
    }

    // `body(segments, t)` on the thread of the asynchronous collectives; the segment list is
    // copied, the memory it points to must stay untouched until completion.
    template <class Body>
    CollectiveHandle launch(Body body, std::span<const Segment> segments, DType t) {
        auto done = std::make_shared<detail::Completion>(waiting_);
        async_.launch([body = std::move(body), held = detail::HeldSegments(segments), t] { body(held.get(), t); },
                      done);
        return CollectiveHandle(std::move(done));
    }

    void reduce(std::span<const Segment> segments, DType t, ReduceOp op, CollectiveTag tag) {
        scatter(segments, t, op, tag);
        gather(segments, t, tag);
    }
    // The node's reduce-scatter, then this rank's share allreduced across the nodes.
    void scatter(std::span<const Segment> segments, DType t, ReduceOp op, CollectiveTag tag) {
        const std::size_t total = detail::total_count(segments);
        const Shard share = shard_of(total, node_.size(), node_.rank());
        guarded([&] {
            detail::reduce_scatter_tagged(node_, segments, t, op, tag);
            // The ranks in this place on every node hold equal shares: all skip an empty one.
            if (share.count > 0) {
                const auto mine = detail::segments_within(segments, share.offset, share.offset + share.count, t);
                detail::allreduce_tagged(across_, std::span<const Segment>(mine), t, op, tag);
            }
        });
        elements_reduced_.fetch_add(total, std::memory_order_relaxed);
        elements_across_.fetch_add(share.count, std::memory_order_relaxed);
    }
    void gather(std::span<const Segment> segments, DType t, CollectiveTag tag) {
        guarded([&] { detail::all_gather_tagged(node_, segments, t, tag); });
    }

    // Every node the same size, and the ranks across the nodes in the same place on each.
    void check_layout() {
        const double local = node_.rank(), size = node_.size();
        double sums[4] = {local, local * local, size, size * size};  // all equal iff n * sum(x^2) == sum(x)^2
        const Segment four{sums, 4};
        guarded([&] { across_.allreduce(std::span<const Segment>(&four, 1), DType::float64, ReduceOp::sum); });
        const double n = across_.size();
        double wrong = sums[1] * n != sums[0] * sums[0] || sums[3] * n != sums[2] * sums[2] ? 1 : 0;
        // A node's ranks sit in different groups across: they fail together, not some of them.
        const Segment one{&wrong, 1};
        guarded([&] { node_.allreduce(std::span<const Segment>(&one, 1), DType::float64, ReduceOp::sum); });
        if (wrong > 0)
            throw Error(detail::rank_prefix(rank()) +
                        ": TwoLevelBackend needs the same number of ranks on every node and, across the nodes, the "
                        "ranks in one place on each (mpi_cross_node_comm gives them); these " +
                        "ranks sit in different places or on nodes of different sizes");
    }

    Node& node_;
    Across& across_;
    std::atomic<std::uint64_t> elements_across_{0};  // written by whichever thread runs a collective
    std::atomic<std::uint64_t> elements_reduced_{0};
    std::shared_ptr<detail::SpinBudget> waiting_ = std::make_shared<detail::SpinBudget>();  // for handles
    detail::AsyncCollectives async_;  // last: destroyed first, drained before the rest
};

}  // namespace gradsync::inline v0
