// Which collective the bucket engine runs over a bucket once its bytes are ready: an allreduce,
// after which every rank holds the whole average (DataParallel), or a reduce-scatter, after which
// each rank holds the average only in its shard of the bucket and the rest is unspecified (a
// backend may use it as scratch), so the engine neither unpacks nor finalizes it: the sharded
// front reads only this rank's shard (ShardedDataParallel). Both over the bucket's segments where
// they lie (in place) or over one contiguous buffer.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/dtype.hpp>

#include <span>

namespace gradsync::inline v0::detail {

template <bool Whole>
struct BucketCollective {
    static constexpr bool whole = Whole;  // every rank receives all of the bucket's average

    template <class B>
    static auto start(B& b, std::span<const Segment> segs, DType t, ReduceOp op, CollectiveTag tag) {
        if constexpr (Whole)
            return allreduce_async_tagged(b, segs, t, op, tag);
        else
            return reduce_scatter_async_tagged(b, segs, t, op, tag);
    }
    template <class B>
    static auto start(B& b, Buffer buf, ReduceOp op, CollectiveTag tag) {
        if constexpr (Whole)
            return allreduce_async_tagged(b, buf, op, tag);
        else
            return reduce_scatter_async_tagged(b, buf, op, tag);
    }
    // The same, run now on this thread.
    template <class B>
    static void run(B& b, std::span<const Segment> segs, DType t, ReduceOp op, CollectiveTag tag) {
        if constexpr (Whole)
            allreduce_tagged(b, segs, t, op, tag);
        else
            reduce_scatter_tagged(b, segs, t, op, tag);
    }
    template <class B>
    static void run(B& b, Buffer buf, ReduceOp op, CollectiveTag tag) {
        if constexpr (Whole)
            allreduce_tagged(b, buf, op, tag);
        else
            reduce_scatter_tagged(b, buf, op, tag);
    }
};

using AllreduceBuckets = BucketCollective<true>;
using ReduceScatterBuckets = BucketCollective<false>;

}  // namespace gradsync::inline v0::detail
