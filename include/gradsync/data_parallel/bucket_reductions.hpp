// How a bucket is reduced. Each way is a type that holds all of it: whether the bucket needs a
// buffer beside its gradients, how its collective starts (launched during backward) and runs
// (now, on this thread), and the pass once it completed. build_slot (bucket_slot.hpp) picks one
// per bucket; the bucket engine calls it through the bucket's slot and knows none by name. The
// ways:
// - InPlaceAllreduce: the gradients allreduced where they lie (a backend that takes scattered
//   segments);
// - BufferAllreduce: as one view when they lie contiguously, else through a packed copy;
// - WireAllreduce: packed into a narrower wire dtype, each rank sending its share of the average;
// - ReduceScatterShard: reduce-scattered, in place or packed; only this rank's shard is averaged,
//   and the sharded front reads it where it lies (no pass after it);
// - HookReduction: through the communication hook (reduction/comm_hook.hpp), float32 gradients
//   as a view or a packed copy, float16 and bfloat16 ones widened into a float32 copy and rounded
//   once when the hook is done.
// An engine's buckets take only the ways that fit it (BucketReductions): an in-place backend's
// plain way is InPlaceAllreduce, another's BufferAllreduce, a reduce-scattering engine's
// ReduceScatterShard. A reduction works on a BucketStep: one bucket's slot in the current step,
// with the backend, the memory policy and the hook it may use.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>

#include <concepts>  // for std::convertible_to
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>  // for std::conditional_t
#include <variant>

namespace gradsync::inline v0::detail {

// Which collective a bucket engine runs: an allreduce, after which every rank holds the whole
// average (DataParallel), or a reduce-scatter, after which each rank holds the average only in
// its shard of the bucket and the rest is unspecified (ShardedDataParallel).
enum class BucketCollective : std::uint8_t { allreduce, reduce_scatter };

// Bucket `index` in this step. InPlace: the engine's backend reduces scattered segments, and its
// handle is the one for them.
template <class BackendT, class Memory, class Slot, class Hooks, bool InPlace, BucketCollective Collective>
struct BucketStep {
    static constexpr bool in_place = InPlace;
    static constexpr bool whole = Collective == BucketCollective::allreduce;

    BackendT& backend;
    Memory& memory;
    Hooks& hooks;
    Slot& slot;
    std::size_t index;
    bool finalizing;  // unscale and measure (else only unpack)
    double unscale;

    // The bucket's gradients where they lie: one segment when they are a view.
    [[nodiscard]] std::span<const Segment> segments() const {
        return slot.view ? std::span<const Segment>(&*slot.view, 1) : std::span<const Segment>(slot.segments);
    }
    [[nodiscard]] std::byte* buffer() const { return slot.buffer_data(); }
    // The gradients packed into the bucket's buffer, as the collective takes it.
    [[nodiscard]] Buffer packed() const {
        memory.pack(slot.table, buffer());
        return Buffer{buffer(), slot.count, slot.dtype};
    }

    // A copy of the (float32) gradients beside the buffer, allocated once.
    [[nodiscard]] std::byte* float32_copy() const {
        if (slot.widened.size() == 0) slot.widened = memory.allocate(Bytes{slot.count * size_of(slot.dtype)});
        return Memory::data(slot.widened);
    }

    // Unscales and measures the gradients where they lie (when finalizing).
    void finalize_in_place() const {
        if (!finalizing) return;
        memory.finalize(slot.table, nullptr, slot.dtype, unscale, index);
        slot.measured = true;
    }
    // The same from the reduced values in `data` (of `type`), unpacking them into the gradients.
    void finalize_from(const std::byte* data, DType type) const {
        memory.finalize(slot.table, data, type, unscale, index);
        slot.measured = true;
    }
};

// What the bucket engine asks of a reduction R over a bucket step S, one requirement each (the
// BucketReduction concept below is their conjunction; check_bucket_reduction names a missing one).
// `deferred`: true when its finish() must wait until every bucket has started (a hook's further
// collectives pair across ranks that overlap and ranks that do not), false when it can also run now.
template <class R>
concept DeclaresDeferral = requires {
    { R::deferred } -> std::convertible_to<bool>;
};
// needs_buffer(slot): whether the bucket needs a buffer beside its gradients.
template <class R, class S>
concept SizesItsBuffer = requires(const R r, S& s) {
    { r.needs_buffer(s.slot) } -> std::convertible_to<bool>;
};
// start(step, tag): starts the bucket's collective (launched during backward, or deferred).
template <class R, class S>
concept StartsCollective = requires(const R r, S& s, CollectiveTag tag) {
    r.start(s, tag);
};
// finish(step): the pass over the bucket once its collective completed.
template <class R, class S>
concept FinishesBucket = requires(const R r, S& s) {
    r.finish(s);
};
// run(step, tag): the collective now, done on return; not asked of a deferred one.
template <class R, class S>
concept RunsNowUnlessDeferred = R::deferred || requires(const R r, S& s, CollectiveTag tag) {
    r.run(s, tag);
};

template <class R, class S>
concept BucketReduction = std::copyable<R> && DeclaresDeferral<R> && SizesItsBuffer<R, S> && StartsCollective<R, S> &&
    FinishesBucket<R, S> && RunsNowUnlessDeferred<R, S>;

// Which requirement of BucketReduction R lacks, named (each reduction an engine's buckets may take
// is checked where the engine is built).
template <class R, class S>
constexpr bool check_bucket_reduction() {
    static_assert(DeclaresDeferral<R>,
                  "gradsync: a bucket reduction needs `static constexpr bool deferred`: true when its finish() must "
                  "wait until every bucket has started (a hook's), false when it can also run now");
    static_assert(SizesItsBuffer<R, S>,
                  "gradsync: a bucket reduction needs `bool needs_buffer(const Slot&) const`: whether the bucket "
                  "needs a buffer beside its gradients");
    static_assert(StartsCollective<R, S>,
                  "gradsync: a bucket reduction needs `void start(Step&, gradsync::CollectiveTag) const`, which "
                  "starts the bucket's collective");
    static_assert(FinishesBucket<R, S>,
                  "gradsync: a bucket reduction needs `void finish(Step&) const`, the pass over the bucket once its "
                  "collective completed");
    if constexpr (DeclaresDeferral<R>)
        static_assert(RunsNowUnlessDeferred<R, S>,
                      "gradsync: a bucket reduction that is not deferred needs `void run(Step&, "
                      "gradsync::CollectiveTag) const`, which runs the bucket's collective now");
    static_assert(std::copyable<R>, "gradsync: a bucket reduction must be copyable");
    return true;
}

template <class S, class... R>
constexpr bool check_bucket_reductions(const std::variant<R...>*) {
    return (check_bucket_reduction<R, S>() && ...);
}

// The gradients allreduced where they lie, and then unscaled and measured there.
struct InPlaceAllreduce {
    static constexpr bool deferred = false;
    template <class Slot>
    [[nodiscard]] bool needs_buffer(const Slot&) const {
        return false;
    }
    template <class S>
    void start(S& s, CollectiveTag tag) const {
        s.slot.handle.emplace(allreduce_async_tagged(s.backend, s.segments(), s.slot.dtype, ReduceOp::average, tag));
    }
    template <class S>
    void run(S& s, CollectiveTag tag) const {
        allreduce_tagged(s.backend, s.segments(), s.slot.dtype, ReduceOp::average, tag);
    }
    template <class S>
    void finish(S& s) const {
        s.finalize_in_place();
    }
};

// An allreduce of one contiguous buffer: Of::contents(s) (the bucket's view, or its buffer once
// filled), by Of::op.
template <class Of>
struct OneBufferAllreduce {
    static constexpr bool deferred = false;
    template <class S>
    void start(S& s, CollectiveTag tag) const {
        s.slot.handle.emplace(allreduce_async_tagged(s.backend, Of::contents(s), Of::op, tag));
    }
    template <class S>
    void run(S& s, CollectiveTag tag) const {
        allreduce_tagged(s.backend, Of::contents(s), Of::op, tag);
    }
};

// The gradients allreduced as one contiguous buffer: their view, or a packed copy unpacked (and
// finalized) after it.
struct BufferAllreduce : OneBufferAllreduce<BufferAllreduce> {
    static constexpr ReduceOp op = ReduceOp::average;
    template <class Slot>
    [[nodiscard]] bool needs_buffer(const Slot& slot) const {
        return !slot.view;
    }
    template <class S>
    static Buffer contents(S& s) {
        if (s.slot.view) return Buffer{s.slot.view->data, s.slot.count, s.slot.dtype};
        return s.packed();
    }
    template <class S>
    void finish(S& s) const {
        if (s.slot.view) return s.finalize_in_place();
        if (!s.finalizing) return s.memory.unpack(s.slot.table, s.buffer());
        s.finalize_from(s.buffer(), s.slot.dtype);
    }
};

// Float32 gradients packed into the narrower wire dtype and summed: each rank sends its share of
// the average (each value divided by the world size), so that the sum keeps the headroom the loss
// scale left. Widened and finalized after it; a float16 sum that overflowed leaves the gradients
// intact, and its result is not finite: the step then reduces the bucket again in float32.
struct WireAllreduce : OneBufferAllreduce<WireAllreduce> {
    static constexpr ReduceOp op = ReduceOp::sum;
    template <class Slot>
    [[nodiscard]] bool needs_buffer(const Slot&) const {
        return true;
    }
    template <class S>
    static Buffer contents(S& s) {
        s.memory.compress(s.slot.table, s.buffer(), s.slot.wire, 1.0 / static_cast<double>(s.backend.size()));
        return Buffer{s.buffer(), s.slot.count, s.slot.wire};
    }
    template <class S>
    void finish(S& s) const {
        s.finalize_from(s.buffer(), s.slot.wire);
    }

    // A float16 sum that overflowed: the bucket reduced again in float32 (averaged), where its
    // gradients lie or through a float32 copy made once, and finalized, the same on every rank
    // (they all hold the same sum, so they all decide alike).
    template <class S>
    void reduce_again_in_float32(S& s, CollectiveTag tag) const {
        auto& slot = s.slot;
        if constexpr (S::in_place) {
            allreduce_tagged(s.backend, s.segments(), slot.dtype, ReduceOp::average, tag);
        } else if (slot.view) {
            allreduce_tagged(s.backend, Buffer{slot.view->data, slot.count, slot.dtype}, ReduceOp::average, tag);
        } else {
            auto* copy = s.float32_copy();
            s.memory.pack(slot.table, copy);
            allreduce_tagged(s.backend, Buffer{copy, slot.count, slot.dtype}, ReduceOp::average, tag);
            s.memory.unpack(slot.table, copy);
        }
        auto again = s;
        again.finalizing = true;  // a compressed bucket is always finalized
        again.finalize_in_place();
    }
};

// The gradients reduce-scattered: where they lie (InPlace, a backend that takes scattered
// segments) or packed. The shard stays where the sharded front reads it (the gradients, or the
// packed buffer), with no pass after it.
template <bool InPlace>
struct ReduceScatterShard {
    static constexpr bool deferred = false;
    template <class Slot>
    [[nodiscard]] bool needs_buffer(const Slot&) const {
        return !InPlace;
    }
    template <class S>
    void start(S& s, CollectiveTag tag) const {
        if constexpr (InPlace)
            s.slot.handle.emplace(
                reduce_scatter_async_tagged(s.backend, s.segments(), s.slot.dtype, ReduceOp::average, tag));
        else
            s.slot.handle.emplace(reduce_scatter_async_tagged(s.backend, s.packed(), ReduceOp::average, tag));
    }
    template <class S>
    void run(S& s, CollectiveTag tag) const {
        if constexpr (InPlace)
            reduce_scatter_tagged(s.backend, s.segments(), s.slot.dtype, ReduceOp::average, tag);
        else
            reduce_scatter_tagged(s.backend, s.packed(), ReduceOp::average, tag);
    }
    template <class S>
    void finish(S&) const {}
};

// The bucket through the communication hook, which sees float32 values: the gradients where they
// lie when they are float32 and contiguous, else packed (16-bit ones widened, exactly). After the
// hook's finish(): the finalize pass, rounding a widened bucket once into the gradients (on an
// allreducing engine; a sharded front reads its shard from the buffer).
struct HookReduction {
    static constexpr bool deferred = true;
    template <class Slot>
    [[nodiscard]] bool needs_buffer(const Slot& slot) const {
        return !slot.view;
    }
    template <class S>
    void start(S& s, CollectiveTag tag) const {
        auto& slot = s.slot;
        if (slot.wire != slot.dtype)
            s.memory.compress(slot.table, s.buffer(), slot.wire, 1.0);  // widened, exactly
        else if (!slot.view)
            s.memory.pack(slot.table, s.buffer());
        slot.hook_step = tag.step;
        slot.pending.emplace(s.hooks.start(s.backend, slot.hooked_bucket(s.index), values(s), tag));
    }
    template <class S>
    void finish(S& s) const {
        auto& slot = s.slot;
        s.hooks.finish(s.backend, slot.hooked_bucket(s.index), values(s), slot.hook_step);
        if constexpr (S::whole) {
            if (slot.view) return s.finalize_in_place();
            if (s.finalizing) {
                s.finalize_from(s.buffer(), slot.wire);
                // The float32 copy unscaled alike, for float32_gradient().
                if (slot.wire != slot.dtype && s.unscale != 1.0) s.memory.scale(slot.float32_table, s.unscale);
                return;
            }
            if (slot.wire == slot.dtype) return s.memory.unpack(slot.table, s.buffer());
            // A widened bucket rounded once into the gradients: the finalize pass with nothing to
            // scale, its measurement left unread.
            s.memory.finalize(slot.table, s.buffer(), slot.wire, 1.0, s.index);
        }
    }

private:
    template <class S>
    static std::span<float> values(S& s) {
        auto* data = s.slot.view ? s.slot.view->data : static_cast<void*>(s.buffer());
        return {static_cast<float*>(data), s.slot.count};
    }
};

// The reductions an engine's buckets may take: its plain one first (in place or through a buffer;
// into a shard when it reduce-scatters), the wire-compressed one (an allreducing engine's), and the
// hook's.
template <bool InPlace, BucketCollective Collective>
using BucketReductions = std::conditional_t<
    Collective == BucketCollective::allreduce,
    std::variant<std::conditional_t<InPlace, InPlaceAllreduce, BufferAllreduce>, WireAllreduce, HookReduction>,
    std::variant<ReduceScatterShard<InPlace>, HookReduction>>;

}  // namespace gradsync::inline v0::detail
