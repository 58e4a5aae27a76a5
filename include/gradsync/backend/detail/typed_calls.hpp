// The typed calls every backend offers alike, written once over each backend's own Buffer and
// byte calls: allreduce(std::span<T>, op = sum), its _async twin, reduce_scatter and all_gather
// with theirs where the backend has them, and broadcast(std::span<T>, root), for any T with a DType (float, double,
// gradsync::float16, gradsync::bfloat16, ...). A trainer written against one backend compiles against every other.
#pragma once

#include <gradsync/buffer.hpp>  // for Buffer, buffer_of, ReduceOp
#include <gradsync/dtype.hpp>

#include <cstddef>
#include <span>
#include <type_traits>  // for std::is_trivially_copyable_v

namespace gradsync::inline v0::detail {

// CRTP base; the backend brings the overloads in with `using TypedCalls<B>::allreduce;` (and
// allreduce_async, broadcast), beside its own Buffer and byte overloads.
template <class Backend>
class TypedCalls {
public:
    template <HasDType T>
    void allreduce(std::span<T> data, ReduceOp op = ReduceOp::sum) {
        self().allreduce(buffer_of(data), op);
    }
    template <HasDType T>
    auto allreduce_async(std::span<T> data, ReduceOp op = ReduceOp::sum) {
        return self().allreduce_async(buffer_of(data), op);
    }
    // Where the backend has them (the ShardedCollectives concept): this rank's shard of `data`.
    template <HasDType T>
    void reduce_scatter(std::span<T> data, ReduceOp op = ReduceOp::sum) {
        self().reduce_scatter(buffer_of(data), op);
    }
    template <HasDType T>
    auto reduce_scatter_async(std::span<T> data, ReduceOp op = ReduceOp::sum) {
        return self().reduce_scatter_async(buffer_of(data), op);
    }
    template <HasDType T>
    void all_gather(std::span<T> data) {
        self().all_gather(buffer_of(data));
    }
    template <HasDType T>
    auto all_gather_async(std::span<T> data) {
        return self().all_gather_async(buffer_of(data));
    }
    // Copies `root`'s values into every other rank's span of the same size.
    template <class T>
    requires std::is_trivially_copyable_v<T>
    void broadcast(std::span<T> data, int root) { self().broadcast(std::as_writable_bytes(data), root); }

private:
    Backend& self() { return static_cast<Backend&>(*this); }
};

}  // namespace gradsync::inline v0::detail
