// BucketEngine: each bucket's storage and its collective in the current step. A bucket travels
// one of five ways: reduced where its gradients lie (a backend that takes scattered segments),
// as one view when they lie contiguously, through a packed copy, packed into a narrower wire
// dtype, or through the communication hook (reduction/comm_hook.hpp): float32 gradients as a view
// or a packed copy, float16 and bfloat16 ones widened into a float32 copy and rounded once when the
// hook is done. The engine launches a bucket's collective (during backward) or runs it now (at
// synchronize()), waits for the launched ones by a deadline (or, on the device, makes the trainer's
// stream wait), and then runs the finalize pass over the bucket through the memory policy: unpack,
// unscale, measure. Each bucket's state is a BucketSlot (bucket_slot.hpp); a hook runs through
// the HookRoute (hook_route.hpp). Collective says whether a bucket is allreduced or
// reduce-scattered into shards (bucket_collective.hpp); a sharded bucket is never a view and
// never finalized here: the sharded front reads its shard.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/data_parallel/bucket_collective.hpp>
#include <gradsync/data_parallel/bucket_slot.hpp>
#include <gradsync/data_parallel/hook_route.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/detail/log.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/memory/policy.hpp>
#include <gradsync/model/model.hpp>
#include <gradsync/reduction/comm_hook.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>  // for std::declval
#include <vector>

namespace gradsync::inline v0::detail {

template <Backend BackendT, MemoryPolicy Memory, DType Wire, bool InPlace, class Hook = NoCommHook,
          class Collective = AllreduceBuckets>
class BucketEngine {
    static constexpr bool compresses = Wire != DType::float32;
    static_assert(Collective::whole || !compresses, "a sharded bucket is not compressed");
    using clock = std::chrono::steady_clock;

    static auto async_of(BackendT& b) {
        if constexpr (InPlace)
            return Collective::start(b, std::span<const Segment>{}, DType::float32, ReduceOp::sum, CollectiveTag{});
        else
            return Collective::start(b, Buffer{}, ReduceOp::sum, CollectiveTag{});
    }

public:
    using handle_type = decltype(async_of(std::declval<BackendT&>()));
    using hook_type = Hook;

    using Slot = BucketSlot<Memory, handle_type>;

    BucketEngine(BackendT& backend, Memory memory, Hook hook = {})
        : backend_(backend), memory_(std::move(memory)), hooks_(std::move(hook)) {}

    void connect_hook(HookContext context) { hooks_.connect(std::move(context)); }

    // (Re)builds every bucket's state from the plan; between steps.
    void setup(const BucketPlan& plan, std::span<const Parameter> params) {
        slots_.clear();
        slots_.resize(plan.buckets.size());
        for (std::size_t b = 0; b < slots_.size(); ++b) build(slots_[b], plan.buckets[b], params);
        memory_.prepare_results(slots_.size());
        if constexpr (Hook::hooked) {
            std::vector<HookedBucket> hooked;
            for (std::size_t b = 0; b < slots_.size(); ++b)
                if (slots_[b].route == Route::hook) hooked.push_back(hooked_bucket(b));
            hooks_.plan(hooked, params.size());
        }
    }

    // Bucket b's gradients moved (a framework that allocates new ones each step): its segments,
    // view and tables follow them. Before its collective; its packed buffer is kept.
    void refresh(std::size_t b, const Bucket& bucket, std::span<const Parameter> params) {
        build(slots_[b], bucket, params);
    }

    // Whether this step's finalize pass unscales and measures (by `unscale`), or, without a loss
    // scaler, compression, clipping or step(), only unpacks packed buckets.
    void begin_step(bool finalizing, double unscale) {
        finalizing_ = finalizing;
        unscale_ = unscale;
    }

    // Bucket b's collective, started asynchronously (during backward, in plan order).
    void launch(std::size_t b, CollectiveTag tag) {
        auto& slot = slots_[b];
        slot.launched_at = clock::now();
        if (alone(b)) return;
        if (slot.route == Route::hook) {
            start_hook(b, tag);
        } else if (slot.route == Route::in_place) {
            if constexpr (InPlace)
                slot.handle.emplace(Collective::start(backend_, segments_of(slot), slot.dtype, ReduceOp::average, tag));
        } else {
            slot.handle.emplace(Collective::start(backend_, contiguous(b), op_of(slot), tag));
        }
    }

    // Bucket b's collective run now, on this thread (no overlap to gain), and finished; on a
    // device, queued like a launch. A hook's bucket is only started: its finish() comes at the
    // wait, after every bucket's start(), as on a rank that launched its buckets during backward,
    // so that the collectives a hook issues in finish() pair across ranks that overlap and ranks
    // that do not.
    void reduce_now(std::size_t b, CollectiveTag tag) {
        auto& slot = slots_[b];
        slot.launched_at = clock::now();
        if (alone(b)) return;
        if constexpr (DeviceBackend<BackendT>) {
            slot.handle.emplace(Collective::start(backend_, contiguous(b), op_of(slot), tag));
            return;
        }
        if (slot.route == Route::hook) return start_hook(b, tag);
        if (slot.route == Route::in_place) {
            if constexpr (InPlace) Collective::run(backend_, segments_of(slot), slot.dtype, ReduceOp::average, tag);
        } else {
            Collective::run(backend_, contiguous(b), op_of(slot), tag);
        }
        finish(b);
        slot.finished_at = clock::now();
    }

    // Waits for every launched bucket by `deadline` and finishes each; diagnose(b) says why one
    // was late. On the device path the trainer's stream waits for each instead, and the finalize
    // pass is queued behind it: the host goes on, and the backend's watchdog ends a collective
    // that hangs.
    template <class Diagnose>
    void wait_all(clock::time_point deadline, Diagnose&& diagnose) {
        for (std::size_t b = 0; b < slots_.size(); ++b) wait(b, deadline, diagnose);
    }

    // The same for bucket b alone (nothing when it was not launched).
    template <class Diagnose>
    void wait(std::size_t b, clock::time_point deadline, Diagnose&& diagnose) {
        auto& slot = slots_[b];
        if (slot.pending) {
            if (!slot.pending->wait_until(deadline)) throw TimeoutError(diagnose(b));
            slot.pending.reset();
            finish_hook(b);
            slot.finished_at = clock::now();
            return;
        }
        if (!slot.handle) return;
        if constexpr (StreamOrdered<BackendT>) {
            backend_.wait_on_device(*slot.handle);
            slot.handle.reset();
            return finish(b);
        }
        if (!slot.handle->wait_until(deadline)) throw TimeoutError(diagnose(b));
        finish(b);
        slot.finished_at = detail::finished_at(*slot.handle);
        slot.handle.reset();
    }

    // Whether bucket b's launched collective has completed (a hook's is waited for).
    [[nodiscard]] bool completed(std::size_t b) const { return slots_[b].handle && slots_[b].handle->ready(); }

    // Unscales and measures bucket b's gradients where they lie (a world of one has nothing to
    // reduce, but a step still needs its norm).
    void finalize_in_place(std::size_t b) {
        // A world of one: a hook's float32 copy is the local gradient, unscaled alike.
        if (hook_widens(slots_[b]))
            memory_.compress(slots_[b].table, Memory::data(slots_[b].buffer), DType::float32,
                             finalizing_ ? unscale_ : 1.0);
        if (!finalizing_) return;
        memory_.finalize(slots_[b].table, nullptr, slots_[b].dtype, unscale_, b);
        slots_[b].measured = true;
    }

    // A compressed bucket whose float16 sum overflowed, reduced again in float32 (averaged) and
    // finalized, the same on every rank: they all hold the same sum, so they all decide alike.
    void reduce_again_in_float(std::size_t b, CollectiveTag tag) {
        auto& slot = slots_[b];
        if constexpr (InPlace) {
            allreduce_tagged(backend_, segments_of(slot), slot.dtype, ReduceOp::average, tag);
        } else {
            Buffer buf{nullptr, slot.count, slot.dtype};
            if (slot.view) {
                buf.data = slot.view->data;
            } else {
                if (slot.widened.size() == 0) slot.widened = memory_.allocate(Bytes{slot.count * size_of(slot.dtype)});
                buf.data = Memory::data(slot.widened);
                memory_.pack(slot.table, Memory::data(slot.widened));
            }
            allreduce_tagged(backend_, buf, ReduceOp::average, tag);
            if (!slot.view) memory_.unpack(slot.table, Memory::data(slot.widened));
        }
        const bool was = finalizing_;
        finalizing_ = true;  // a compressed bucket is always finalized
        finalize_in_place(b);
        finalizing_ = was;
    }

    // Scales every gradient by `factor` (clipping's second pass).
    void scale_all(double factor) {
        for (const auto& slot : slots_) {
            memory_.scale(slot.table, factor);
            if (hook_widens(slot)) memory_.scale(slot.float32_table, factor);
        }
    }

    // Parameter `name`'s averaged gradient in float32, where its bucket went through the hook
    // widened: the copy the model's 16-bit gradient was rounded from. Empty for a zero-sized one.
    [[nodiscard]] std::span<const float> float32_gradient(const ModelLayout& layout, std::string_view name) const {
        return hooks_.float32_gradient(layout, name, [this](std::size_t b) {
            return reinterpret_cast<const float*>(Memory::data(slots_[b].buffer));
        });
    }

    [[nodiscard]] bool in_flight() const {
        for (const auto& s : slots_)
            if (s.handle || s.pending) return true;
        return false;
    }

    // Waits for collectives in flight until `deadline`, ignoring their errors: after an abort
    // they end at once.
    void drain(clock::time_point deadline) {
        for (auto& slot : slots_) {
            try {
                if (slot.handle) (void)slot.handle->wait_until(deadline);
                if (slot.pending) (void)slot.pending->wait_until(deadline);
            } catch (...) {
            }
            slot.handle.reset();
            slot.pending.reset();
        }
    }

    void end_step() {
        for (auto& slot : slots_) slot.measured = false;
    }

    [[nodiscard]] std::span<Slot> slots() { return slots_; }
    [[nodiscard]] std::span<const Slot> slots() const { return slots_; }
    [[nodiscard]] Memory& memory() { return memory_; }
    [[nodiscard]] const Memory& memory() const { return memory_; }
    [[nodiscard]] Hook& hook() { return hooks_.hook(); }
    [[nodiscard]] const Hook& hook() const { return hooks_.hook(); }

    // Buckets whose gradients already lie contiguously in memory, reduced without a copy.
    [[nodiscard]] std::size_t view_buckets() const {
        std::size_t n = 0;
        for (const auto& s : slots_) n += s.view.has_value() && s.route != Route::compressed;
        return n;
    }
    // Bucket buffers and bookkeeping, beyond the model's own memory.
    [[nodiscard]] Bytes memory_held() const {
        Bytes total;
        for (const auto& s : slots_)
            total += Bytes{s.buffer.size() + s.widened.size() + s.segments.capacity() * sizeof(Segment) +
                           s.indices.capacity() * sizeof(std::size_t)};
        return total;
    }

private:
    void build(Slot& slot, const Bucket& bucket, std::span<const Parameter> params) {
        build_slot(slot, bucket, params, memory_,
                   RouteRules{Hook::hooked, Wire, InPlace, Collective::whole, backend_.size() > 1});
    }

    [[nodiscard]] static bool hook_widens(const Slot& slot) { return slot.widened_for_hook(); }

    // A world of one: the local gradient is the average, so nothing is reduced (and no hook
    // runs); a shard is still packed where the front reads it.
    bool alone(std::size_t b) {
        if (backend_.size() > 1) return false;
        auto& slot = slots_[b];
        if constexpr (!Collective::whole)
            if (slot.route != Route::in_place) memory_.pack(slot.table, Memory::data(slot.buffer));
        return true;
    }

    // The bucket's gradients where they lie: one segment when they are a view.
    static std::span<const Segment> segments_of(const Slot& slot) {
        return slot.view ? std::span<const Segment>(&*slot.view, 1) : std::span<const Segment>(slot.segments);
    }

    // A compressed bucket is summed (each rank sent its share); every other one averaged.
    [[nodiscard]] static ReduceOp op_of(const Slot& slot) {
        return slot.route == Route::compressed ? ReduceOp::sum : ReduceOp::average;
    }

    // The bucket's collective as one contiguous buffer, packing (and converting) first when it is
    // no view. A compressed bucket's ranks send their share of the average: each value divided by
    // the world size, so that the sum keeps the headroom the loss scale left.
    Buffer contiguous(std::size_t b) {
        auto& slot = slots_[b];
        if (slot.route == Route::view) return Buffer{slot.view->data, slot.count, slot.dtype};
        std::byte* data = Memory::data(slot.buffer);
        if (slot.route == Route::packed)
            memory_.pack(slot.table, data);
        else
            memory_.compress(slot.table, data, slot.wire, 1.0 / static_cast<double>(backend_.size()));
        return Buffer{data, slot.count, slot.wire};
    }

    // After bucket b's reduction: the finalize pass. Packed buckets are unpacked in it; compressed
    // ones widened (a float16 sum that overflowed leaves the gradients intact, and its result is
    // not finite: the step then reduces it again in float32); the others scaled where they lie.
    void finish(std::size_t b) {
        if constexpr (!Collective::whole) return;  // only this rank's shard is reduced
        auto& slot = slots_[b];
        const std::byte* data = Memory::data(slot.buffer);
        switch (slot.route) {
            case Route::in_place:
            case Route::view: return finalize_in_place(b);
            case Route::packed:
                if (!finalizing_) return memory_.unpack(slot.table, data);
                return finalize_from(b, data, slot.dtype);
            case Route::compressed: return finalize_from(b, data, slot.wire);
            case Route::hook:
                if (slot.view) return finalize_in_place(b);
                if (finalizing_) {
                    finalize_from(b, data, slot.wire);
                    // The float32 copy unscaled alike, for float32_gradient().
                    if (slot.wire != slot.dtype && unscale_ != 1.0) memory_.scale(slot.float32_table, unscale_);
                    return;
                }
                if (slot.wire == slot.dtype) return memory_.unpack(slot.table, data);
                // A widened bucket rounded once into the gradients: the finalize pass with nothing to
                // scale, its measurement left unread.
                return memory_.finalize(slot.table, data, slot.wire, 1.0, b);
        }
    }

    HookedBucket hooked_bucket(std::size_t b) const {
        const auto& slot = slots_[b];
        return HookedBucket{b, slot.hooked, slot.indices, slot.dtype};
    }
    // The bucket's values as the hook sees them: its float32 gradients where they lie when
    // contiguous, else packed (16-bit ones widened).
    std::span<float> hook_values(std::size_t b) {
        auto& slot = slots_[b];
        auto* values = static_cast<float*>(slot.view ? slot.view->data : static_cast<void*>(Memory::data(slot.buffer)));
        return {values, slot.count};
    }

    void start_hook(std::size_t b, CollectiveTag tag) {
        auto& slot = slots_[b];
        if (slot.wire != slot.dtype)
            memory_.compress(slot.table, Memory::data(slot.buffer), slot.wire, 1.0);  // widened, exactly
        else if (!slot.view)
            memory_.pack(slot.table, Memory::data(slot.buffer));
        slot.hook_step = tag.step;
        slot.pending.emplace(hooks_.start(backend_, hooked_bucket(b), hook_values(b), tag));
    }

    // After the hook's collectives of bucket b completed: its finish(), then the finalize pass.
    void finish_hook(std::size_t b) {
        hooks_.finish(backend_, hooked_bucket(b), hook_values(b), slots_[b].hook_step);
        finish(b);
    }

    void finalize_from(std::size_t b, const std::byte* data, DType type) {
        memory_.finalize(slots_[b].table, data, type, unscale_, b);
        slots_[b].measured = true;
    }

    BackendT& backend_;
    Memory memory_;
    HookRoute<BackendT, Hook> hooks_;
    std::vector<Slot> slots_;
    bool finalizing_ = false;
    double unscale_ = 1.0;
};

}  // namespace gradsync::inline v0::detail
