// What a communication backend provides: the Backend concept (the required core: rank, size,
// allreduce, broadcast, barrier) and one named concept per optional ability DataParallel uses
// when a backend has it (reduce_scatter and all_gather among them), each with a check that names
// what is missing.
#pragma once

#include <gradsync/backend/handle.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>

#include <chrono>
#include <concepts>  // for std::convertible_to
#include <cstdint>
#include <functional>  // for std::function
#include <span>
#include <string>

namespace gradsync::inline v0 {

namespace detail {

// The dtypes the host backends reduce: the floating ones (16-bit accumulated in float).
inline bool reducible(DType t) {
    return t == DType::float32 || t == DType::float64 || t == DType::float16 || t == DType::bfloat16;
}

}  // namespace detail

// A backend runs collectives among the ranks of one group. Every rank calls the same collectives
// in the same order; a backend reports a mismatch as an exception rather than hanging.
template <class B>
concept Backend = requires(B& b, const B& cb, Buffer buf, ReduceOp op, std::span<std::byte> bytes, int root, DType t) {
    { cb.rank() } -> std::convertible_to<int>;
    { cb.size() } -> std::convertible_to<int>;
    { cb.supports(t) } -> std::convertible_to<bool>;
    b.allreduce(buf, op);
    { b.allreduce_async(buf, op) } -> Waitable;
    b.broadcast(bytes, root);
    b.barrier();
};

// A backend that reduces gradients where they lie, over a list of segments, so DataParallel
// needs no bucket buffer and no pack or unpack copy (LocalBackend, in shared memory).
template <class B>
concept ScatteredAllreduce = Backend<B> && requires(B& b, std::span<const Segment> segs, DType t, ReduceOp op) {
    b.allreduce(segs, t, op);
    { b.allreduce_async(segs, t, op) } -> Waitable;
};

// Optional abilities. DataParallel asks these concepts, never the members themselves.

// reduce_scatter and all_gather, what sharded data parallel needs. Each rank owns the shard
// shard_of(buf.count, size(), rank()) of a buffer of the same size on every rank.
// reduce_scatter(buf, op) leaves the reduction over the ranks in this rank's shard of `buf` and
// the rest of `buf` unspecified (a backend may use it as scratch); all_gather(buf) copies every
// rank's shard of its `buf` into the same place of every other rank's.
template <class B>
concept ShardedCollectives = Backend<B> && requires(B& b, Buffer buf, ReduceOp op) {
    b.reduce_scatter(buf, op);
    { b.reduce_scatter_async(buf, op) } -> Waitable;
    b.all_gather(buf);
    { b.all_gather_async(buf) } -> Waitable;
};

// Sharded collectives whose shards are replicated (hybrid sharding, TwoLevelBackend): a buffer is
// split among the shard_ranks() ranks of this rank's shard group (its node) alone, this rank's
// shard being shard_of(buf.count, shard_ranks(), shard_rank()); reduce_scatter leaves the
// reduction over every rank of the backend in it, and all_gather copies within the shard group.
// The size() / shard_ranks() groups hold the same shards; replica() numbers this rank's (0 for
// the first).
template <class B>
concept ReplicatedShards = ShardedCollectives<B> && requires(const B& cb) {
    { cb.shard_ranks() } -> std::convertible_to<int>;
    { cb.shard_rank() } -> std::convertible_to<int>;
    { cb.replica() } -> std::convertible_to<int>;
};

// ...and over a list of segments too, so that shards are reduced and gathered where the
// gradients and parameters lie (LocalBackend).
template <class B>
concept ScatteredShardedCollectives = ShardedCollectives<B> &&
    requires(B& b, std::span<const Segment> segs, DType t, ReduceOp op) {
    b.reduce_scatter(segs, t, op);
    { b.reduce_scatter_async(segs, t, op) } -> Waitable;
    b.all_gather(segs, t);
    { b.all_gather_async(segs, t) } -> Waitable;
};

// ...with a CollectiveTag each, like TaggedCollectives.
template <class B>
concept TaggedShardedCollectives = ShardedCollectives<B> && requires(B& b, Buffer buf, ReduceOp op, CollectiveTag tag) {
    b.reduce_scatter(buf, op, tag);
    { b.reduce_scatter_async(buf, op, tag) } -> Waitable;
    b.all_gather(buf, tag);
    { b.all_gather_async(buf, tag) } -> Waitable;
};

// ...and the scattered ones too.
template <class B>
concept TaggedScatteredShardedCollectives = ScatteredShardedCollectives<B> &&
    requires(B& b, std::span<const Segment> segs, DType t, ReduceOp op, CollectiveTag tag) {
    b.reduce_scatter(segs, t, op, tag);
    { b.reduce_scatter_async(segs, t, op, tag) } -> Waitable;
    b.all_gather(segs, t, tag);
    { b.all_gather_async(segs, t, tag) } -> Waitable;
};

// Collectives that carry a CollectiveTag (to name them in errors, and to check them): the
// allreduce and the broadcast, and the scattered allreduce where there is one.
template <class B>
concept TaggedCollectives = Backend<B> &&
    requires(B& b, Buffer buf, std::span<std::byte> bytes, ReduceOp op, CollectiveTag tag) {
    b.allreduce(buf, op, tag);
    { b.allreduce_async(buf, op, tag) } -> Waitable;
    b.broadcast(bytes, 0, tag);
};

// ...and the scattered allreduce too.
template <class B>
concept TaggedScatteredAllreduce = ScatteredAllreduce<B> &&
    requires(B& b, std::span<const Segment> segs, DType t, ReduceOp op, CollectiveTag tag) {
    b.allreduce(segs, t, op, tag);
    { b.allreduce_async(segs, t, op, tag) } -> Waitable;
};

// ...and checked against the other ranks' tags at every call (`static constexpr bool
// checks_tags = true`), so that DataParallel needs no per-step history check of its own.
template <class B>
concept CheckedCollectives = TaggedCollectives<B> && requires {
    requires B::checks_tags;
};

// A backend that sums every element over the ranks in rank order (0, 1, 2, ...) whatever the
// collective's size and the element's place in it (`static constexpr bool sums_in_rank_order =
// true`, LocalBackend): how gradients are cut into buckets cannot change a bit of the result.
template <class B>
concept RankOrderedSums = Backend<B> && requires {
    requires B::sums_in_rank_order;
};

// A backend whose collectives take device memory (`static constexpr bool device_memory = true`,
// NcclBackend): DataParallel's gradients must then lie on the device.
template <class B>
concept DeviceBackend = Backend<B> && requires {
    requires B::device_memory;
};

// abort(reason): every pending and future collective of every rank fails with `reason`, so that
// a failure on one rank reaches the others at once rather than at their deadline.
template <class B>
concept Abortable = Backend<B> && requires(B& b, const std::string& reason) {
    b.abort(reason);
};

// Each rank can leave reporters that say where it stands; the backend quotes them when one of
// this rank's collectives misses its deadline (MpiBackend).
template <class B>
concept StatusReporting = Backend<B> && requires(B& b, std::function<std::string()> reporter, std::uint64_t id) {
    { b.add_status_reporter(reporter) } -> std::convertible_to<std::uint64_t>;
    b.remove_status_reporter(id);
};

// ...and peers can call them, without a collective, when they need to say why this rank is late
// (LocalBackend: shared memory).
template <class B>
concept PeerStatus = StatusReporting<B> && requires(const B& cb, int rank) {
    { cb.peer_status(rank) } -> std::convertible_to<std::string>;
    { cb.peer_collectives(rank) } -> std::convertible_to<std::uint64_t>;  // how many it has entered
};

// ...or, where peers live in other processes, can ask them (MpiBackend: a message to each, which
// its watcher answers): " Where the peers stand: ...", waiting up to a second.
template <class B>
concept AsksPeers = Backend<B> && requires(const B& cb) {
    { cb.where_peers_stand() } -> std::convertible_to<std::string>;
};

// The sum over the ranks of a factor times each rank's buffer, in one pass (NcclBackend's
// pre-multiplied sum): folds an unscaling factor into the reduction.
template <class B>
concept PreScaledAllreduce = Backend<B> && requires(B& b, Buffer buf, double factor) {
    { b.allreduce_scaled_async(buf, factor) } -> Waitable;
};

// A backend whose host does not wait for its collectives (NcclBackend) and so learns of a
// failure only when asked: throw_if_failed() throws what its watchdog found.
template <class B>
concept HealthPolling = Backend<B> && requires(const B& cb) {
    cb.throw_if_failed();
};

// Collectives ordered on the device: each one waits for what the trainer's compute stream was
// given before it, and wait_on_device(handle) makes that stream wait for it, the host for
// neither (NcclBackend, CudaLocalBackend).
template <class B>
concept StreamOrdered = DeviceBackend<B> && requires(B& b, const B& cb, Buffer buf, ReduceOp op) {
    cb.compute_stream();
    b.wait_on_device(b.allreduce_async(buf, op));
};

// A backend that says by when each of its blocking collectives ends: options().timeout
// (LocalBackend, MpiBackend).
template <class B>
concept TimedCollectives = Backend<B> && requires(const B& cb) {
    { cb.options().timeout } -> std::convertible_to<std::chrono::milliseconds>;
};

namespace detail {

// Whether b's blocking collectives end by `timeout` on their own; false where b does not say.
template <Backend B>
bool ends_within(const B& b, std::chrono::milliseconds timeout) {
    if constexpr (TimedCollectives<B>)
        return std::chrono::milliseconds(b.options().timeout) <= timeout;
    else
        return false;
}

// How a sharded backend splits a buffer: among all its ranks, or its shard group's
// (ReplicatedShards), and which copy of the shards this rank holds.
template <Backend B>
int shard_ranks(const B& b) {
    if constexpr (ReplicatedShards<B>)
        return b.shard_ranks();
    else
        return b.size();
}
template <Backend B>
int shard_rank(const B& b) {
    if constexpr (ReplicatedShards<B>)
        return b.shard_rank();
    else
        return b.rank();
}
template <Backend B>
int replica(const B& b) {
    if constexpr (ReplicatedShards<B>)
        return b.replica();
    else
        return 0;
}

// A backend's collectives with the tag where it takes one, without it where it does not: the
// one place that decides.
template <Backend B>
void allreduce_tagged(B& b, Buffer buf, ReduceOp op, CollectiveTag tag) {
    if constexpr (TaggedCollectives<B>)
        b.allreduce(buf, op, tag);
    else
        b.allreduce(buf, op);
}
template <Backend B>
auto allreduce_async_tagged(B& b, Buffer buf, ReduceOp op, CollectiveTag tag) {
    if constexpr (TaggedCollectives<B>)
        return b.allreduce_async(buf, op, tag);
    else
        return b.allreduce_async(buf, op);
}
template <ScatteredAllreduce B>
void allreduce_tagged(B& b, std::span<const Segment> segs, DType t, ReduceOp op, CollectiveTag tag) {
    if constexpr (TaggedScatteredAllreduce<B>)
        b.allreduce(segs, t, op, tag);
    else
        b.allreduce(segs, t, op);
}
template <ScatteredAllreduce B>
auto allreduce_async_tagged(B& b, std::span<const Segment> segs, DType t, ReduceOp op, CollectiveTag tag) {
    if constexpr (TaggedScatteredAllreduce<B>)
        return b.allreduce_async(segs, t, op, tag);
    else
        return b.allreduce_async(segs, t, op);
}
template <Backend B>
void broadcast_tagged(B& b, std::span<std::byte> bytes, int root, CollectiveTag tag) {
    if constexpr (TaggedCollectives<B>)
        b.broadcast(bytes, root, tag);
    else
        b.broadcast(bytes, root);
}

template <ShardedCollectives B>
void reduce_scatter_tagged(B& b, Buffer buf, ReduceOp op, CollectiveTag tag) {
    if constexpr (TaggedShardedCollectives<B>)
        b.reduce_scatter(buf, op, tag);
    else
        b.reduce_scatter(buf, op);
}
template <ShardedCollectives B>
auto reduce_scatter_async_tagged(B& b, Buffer buf, ReduceOp op, CollectiveTag tag) {
    if constexpr (TaggedShardedCollectives<B>)
        return b.reduce_scatter_async(buf, op, tag);
    else
        return b.reduce_scatter_async(buf, op);
}
template <ShardedCollectives B>
void all_gather_tagged(B& b, Buffer buf, CollectiveTag tag) {
    if constexpr (TaggedShardedCollectives<B>)
        b.all_gather(buf, tag);
    else
        b.all_gather(buf);
}
template <ShardedCollectives B>
auto all_gather_async_tagged(B& b, Buffer buf, CollectiveTag tag) {
    if constexpr (TaggedShardedCollectives<B>)
        return b.all_gather_async(buf, tag);
    else
        return b.all_gather_async(buf);
}
template <ScatteredShardedCollectives B>
void reduce_scatter_tagged(B& b, std::span<const Segment> segs, DType t, ReduceOp op, CollectiveTag tag) {
    if constexpr (TaggedScatteredShardedCollectives<B>)
        b.reduce_scatter(segs, t, op, tag);
    else
        b.reduce_scatter(segs, t, op);
}
template <ScatteredShardedCollectives B>
auto reduce_scatter_async_tagged(B& b, std::span<const Segment> segs, DType t, ReduceOp op, CollectiveTag tag) {
    if constexpr (TaggedScatteredShardedCollectives<B>)
        return b.reduce_scatter_async(segs, t, op, tag);
    else
        return b.reduce_scatter_async(segs, t, op);
}
template <ScatteredShardedCollectives B>
void all_gather_tagged(B& b, std::span<const Segment> segs, DType t, CollectiveTag tag) {
    if constexpr (TaggedScatteredShardedCollectives<B>)
        b.all_gather(segs, t, tag);
    else
        b.all_gather(segs, t);
}
template <ScatteredShardedCollectives B>
auto all_gather_async_tagged(B& b, std::span<const Segment> segs, DType t, CollectiveTag tag) {
    if constexpr (TaggedScatteredShardedCollectives<B>)
        return b.all_gather_async(segs, t, tag);
    else
        return b.all_gather_async(segs, t);
}

}  // namespace detail

}  // namespace gradsync::inline v0
