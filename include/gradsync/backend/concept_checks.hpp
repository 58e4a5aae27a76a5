// What a backend lacks for what it is asked to do, named: the readable compile errors behind the
// concepts of backend/concepts.hpp (a backend at all, sharded collectives, scattered segments,
// device streams), each reporting the first missing member only.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/handle.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/detail/meta.hpp>
#include <gradsync/dtype.hpp>

#include <concepts>  // for std::convertible_to
#include <cstddef>
#include <span>

namespace gradsync::inline v0::detail {

template <class B>
constexpr bool check_backend() {
    if constexpr (!Backend<B>) {
        static_assert(
            requires(const B& b) {
                { b.rank() } -> std::convertible_to<int>;
            },
            "gradsync: a Backend needs `int rank() const`");
        static_assert(
            requires(const B& b) {
                { b.size() } -> std::convertible_to<int>;
            },
            "gradsync: a Backend needs `int size() const`");
        static_assert(
            requires(const B& b, DType t) {
                { b.supports(t) } -> std::convertible_to<bool>;
            },
            "gradsync: a Backend needs `bool supports(gradsync::DType) const`");
        static_assert(
            requires(B & b, Buffer buf, ReduceOp op) { b.allreduce(buf, op); },
            "gradsync: a Backend needs `void allreduce(gradsync::Buffer, gradsync::ReduceOp)`");
        static_assert(
            requires(B & b, Buffer buf, ReduceOp op) {
                { b.allreduce_async(buf, op) } -> Waitable;
            },
            "gradsync: a Backend needs `Handle allreduce_async(gradsync::Buffer, gradsync::ReduceOp)` "
            "returning a handle with `void wait() const`, `bool ready() const` and "
            "`bool wait_until(std::chrono::steady_clock::time_point) const`");
        static_assert(
            requires(B & b, std::span<std::byte> bytes, int root) { b.broadcast(bytes, root); },
            "gradsync: a Backend needs `void broadcast(std::span<std::byte>, int root)`");
        static_assert(
            requires(B & b) { b.barrier(); }, "gradsync: a Backend needs `void barrier()`");
    }
    return Backend<B>;
}

// What a backend for sharded data parallel lacks, named.
template <class B>
constexpr bool check_sharded_collectives() {
    static_assert(
        requires(B & b, Buffer buf, ReduceOp op) { b.reduce_scatter(buf, op); },
        "gradsync: sharding needs a backend with `void reduce_scatter(gradsync::Buffer, gradsync::ReduceOp)` (the "
        "ShardedCollectives concept: LocalBackend, MpiBackend, NcclBackend, CudaLocalBackend)");
    static_assert(
        requires(B & b, Buffer buf, ReduceOp op) {
            { b.reduce_scatter_async(buf, op) } -> Waitable;
        },
        "gradsync: sharding needs a backend with `Handle reduce_scatter_async(gradsync::Buffer, gradsync::ReduceOp)` "
        "(the ShardedCollectives concept)");
    static_assert(
        requires(B & b, Buffer buf) { b.all_gather(buf); },
        "gradsync: sharding needs a backend with `void all_gather(gradsync::Buffer)` (the ShardedCollectives concept)");
    static_assert(
        requires(B & b, Buffer buf) {
            { b.all_gather_async(buf) } -> Waitable;
        },
        "gradsync: sharding needs a backend with `Handle all_gather_async(gradsync::Buffer)` (the ShardedCollectives "
        "concept)");
    return ShardedCollectives<B>;
}

// What a scattered-allreduce backend lacks, named (InPlaceBuckets needs one).
template <class B>
constexpr bool check_scattered_allreduce() {
    static_assert(
        requires(B & b, std::span<const Segment> segs, DType t, ReduceOp op) { b.allreduce(segs, t, op); },
        "gradsync: InPlaceBuckets needs a backend that reduces scattered segments (the ScatteredAllreduce "
        "concept, e.g. LocalBackend): `void allreduce(std::span<const gradsync::Segment>, gradsync::DType, "
        "gradsync::ReduceOp)`; use PackedBuckets or AutoPacking");
    static_assert(
        requires(B & b, std::span<const Segment> segs, DType t, ReduceOp op) {
            { b.allreduce_async(segs, t, op) } -> Waitable;
        },
        "gradsync: InPlaceBuckets needs a backend that reduces scattered segments (the ScatteredAllreduce "
        "concept): `Handle allreduce_async(std::span<const gradsync::Segment>, gradsync::DType, "
        "gradsync::ReduceOp)`; use PackedBuckets or AutoPacking");
    return true;
}

// What a backend for device gradients lacks, named, the first only (a device memory policy needs
// one).
template <class B>
constexpr bool check_stream_ordered() {
    if constexpr (!DeviceBackend<B>)
        static_assert(DeviceBackend<B>,
                      "gradsync: a device memory policy (CudaMemory) needs a backend whose collectives take device "
                      "memory (NcclBackend, CudaLocalBackend): `static constexpr bool device_memory = true`");
    else if constexpr (!requires(const B& b) { b.compute_stream(); })
        static_assert(dependent_false<B>,
                      "gradsync: a device memory policy (CudaMemory) needs a backend that orders its collectives "
                      "after the trainer's stream: `cudaStream_t compute_stream() const`");
    else
        static_assert(
            requires(B & b, Buffer buf, ReduceOp op) { b.wait_on_device(b.allreduce_async(buf, op)); },
            "gradsync: a device memory policy (CudaMemory) needs a backend whose collectives the trainer's stream "
            "can wait for: `void wait_on_device(const Handle&)`");
    return true;
}
// ...only where the memory policy keeps gradients on the device (`Needed`).
template <class B, bool Needed>
constexpr bool check_stream_ordered_if() {
    if constexpr (Needed) return check_stream_ordered<B>();
    return true;
}
// ...only where the policies need the ability (InPlaceBuckets).
template <class B, bool Needed>
constexpr bool check_scattered_allreduce_if() {
    if constexpr (Needed) return check_scattered_allreduce<B>();
    return true;
}

}  // namespace gradsync::inline v0::detail
