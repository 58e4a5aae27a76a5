// BucketEngine: each bucket's storage and its collective in the current step. How a bucket is
// reduced is its reduction (bucket_reductions.hpp), picked when the bucket is built: in place,
// as a view or a packed copy, compressed to a wire dtype, reduce-scattered into shards, or
// through the communication hook. The engine launches a bucket's collective (during backward) or
// runs it now (at synchronize()), waits for the launched ones by a deadline (or, on the device,
// makes the trainer's stream wait), and then has the reduction run its pass over the bucket
// through the memory policy: unpack, unscale, measure. Each bucket's state is a BucketSlot
// (bucket_slot.hpp); a hook runs through the HookRoute (hook_route.hpp). A reduce-scattering
// engine's buckets are never views and never finalized here: the sharded front reads its shard.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/data_parallel/bucket_reductions.hpp>
#include <gradsync/data_parallel/bucket_slot.hpp>
#include <gradsync/data_parallel/hook_route.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/memory/policy.hpp>
#include <gradsync/model/model.hpp>
#include <gradsync/reduction/comm_hook.hpp>

#include <algorithm>  // for std::max
#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>  // for std::decay_t
#include <utility>      // for std::declval, std::move
#include <variant>
#include <vector>

namespace gradsync::inline v0::detail {

template <Backend BackendT, MemoryPolicy Memory, DType Wire, bool InPlace, class Hook = NoCommHook,
          BucketCollective Collective = BucketCollective::allreduce>
class BucketEngine {
    static constexpr bool whole = Collective == BucketCollective::allreduce;
    static_assert(whole || Wire == DType::float32, "a sharded bucket is not compressed");
    using clock = std::chrono::steady_clock;

    static auto async_of(BackendT& b) {
        const std::span<const Segment> segs;
        if constexpr (whole && InPlace)
            return allreduce_async_tagged(b, segs, DType::float32, ReduceOp::sum, CollectiveTag{});
        else if constexpr (whole)
            return allreduce_async_tagged(b, Buffer{}, ReduceOp::sum, CollectiveTag{});
        else if constexpr (InPlace)
            return reduce_scatter_async_tagged(b, segs, DType::float32, ReduceOp::sum, CollectiveTag{});
        else
            return reduce_scatter_async_tagged(b, Buffer{}, ReduceOp::sum, CollectiveTag{});
    }

public:
    using handle_type = decltype(async_of(std::declval<BackendT&>()));
    using hook_type = Hook;
    using Reductions = BucketReductions<InPlace, Collective>;
    using Slot = BucketSlot<Memory, handle_type, Reductions>;
    using Step = BucketStep<BackendT, Memory, Slot, HookRoute<BackendT, Hook>, InPlace, Collective>;

    static_assert(check_bucket_reductions<Step>(static_cast<const Reductions*>(nullptr)));

    BucketEngine(BackendT& backend, Memory memory, Hook hook = {})
        : backend_(backend), memory_(std::move(memory)), hooks_(std::move(hook)) {
        if constexpr (requires { static_cast<void*>(memory_.stream()); })
            hooks_.set_stream(static_cast<void*>(memory_.stream()));  // a hook on the device launches there
    }

    void connect_hook(HookContext context) { hooks_.connect(std::move(context)); }

    // A reduce-scattering engine whose front keeps each bucket's shard before it launches the
    // bucket `n` places later (stage 2): `n` buffers lent in turn (bucket b borrows buffer b % n,
    // as large as the largest bucket it serves) instead of a buffer per bucket. Before setup().
    void share_buffers(std::size_t n) requires(!whole) { shared_ = n; }

    // (Re)builds every bucket's state from the plan; between steps.
    void setup(const BucketPlan& plan, std::span<const Parameter> params) {
        slots_.clear();
        slots_.resize(plan.buckets.size());
        for (std::size_t b = 0; b < slots_.size(); ++b) build(slots_[b], plan.buckets[b], params);
        lend_buffers();
        memory_.prepare_results(slots_.size() + (whole ? 0 : 1));  // reduce-scattering: one for the front
        if constexpr (Hook::hooked) {
            std::vector<HookedBucket> hooked;
            for (std::size_t b = 0; b < slots_.size(); ++b)
                if (slots_[b].template reduced_by<HookReduction>()) hooked.push_back(slots_[b].hooked_bucket(b));
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
        slots_[b].launched_at = clock::now();
        if (alone(b)) return;
        with_reduction(b, [&](const auto& r, Step& s) { r.start(s, tag); });
    }

    // Bucket b's collective run now, on this thread (no overlap to gain), and finished; on a
    // device, queued like a launch. A deferred reduction (the hook's) is only started: its
    // finish() comes at the wait, after every bucket's start(), as on a rank that launched its
    // buckets during backward, so that the collectives a hook issues in finish() pair across ranks
    // that overlap and ranks that do not.
    void reduce_now(std::size_t b, CollectiveTag tag) {
        auto& slot = slots_[b];
        slot.launched_at = clock::now();
        if (alone(b)) return;
        with_reduction(b, [&](const auto& r, Step& s) {
            if constexpr (std::decay_t<decltype(r)>::deferred || DeviceBackend<BackendT>) {
                r.start(s, tag);
            } else {
                r.run(s, tag);
                r.finish(s);
                slot.finished_at = clock::now();
            }
        });
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
            finish(b);
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

    // A world of one: unscales and measures bucket b's gradients where they lie (there is nothing
    // to reduce, but a step still needs its norm); a hook's float32 copy is the local gradient,
    // unscaled alike.
    void finalize_in_place(std::size_t b) {
        auto& slot = slots_[b];
        if (slot.widened_for_hook())
            memory_.compress(slot.table, slot.buffer_data(), DType::float32, finalizing_ ? unscale_ : 1.0);
        step_of(b).finalize_in_place();
    }

    // A compressed bucket whose float16 sum overflowed, reduced again in float32 and finalized.
    void reduce_again_in_float(std::size_t b, CollectiveTag tag) requires(whole) {
        auto step = step_of(b);
        std::get<WireAllreduce>(slots_[b].reduction).reduce_again_in_float32(step, tag);
    }

    // Scales every gradient by `factor` (clipping's second pass).
    void scale_all(double factor) {
        for (const auto& slot : slots_) {
            memory_.scale(slot.table, factor);
            if (slot.widened_for_hook()) memory_.scale(slot.float32_table, factor);
        }
    }

    // Parameter `name`'s averaged gradient in float32, where its bucket went through the hook
    // widened: the copy the model's 16-bit gradient was rounded from. Empty for a zero-sized one.
    [[nodiscard]] std::span<const float> float32_gradient(const ModelLayout& layout, std::string_view name) const {
        return hooks_.float32_gradient(
            layout, name, [this](std::size_t b) { return reinterpret_cast<const float*>(slots_[b].buffer_data()); });
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

    // A reduce-scattering engine's result slot that no bucket's pass writes: the sharded front's
    // decision measures its shards there.
    [[nodiscard]] std::size_t spare_result_slot() const requires(!whole) { return slots_.size(); }
    // Buckets whose gradients already lie contiguously in memory, reduced without a copy.
    [[nodiscard]] std::size_t view_buckets() const {
        std::size_t n = 0;
        for (const auto& s : slots_) n += s.view.has_value() && !s.needs_buffer();
        return n;
    }
    // Where bucket b's reduced values lie when its reduction goes through its buffer (a sharded
    // front reads its shard there); null when it is reduced where its gradients lie.
    [[nodiscard]] std::byte* reduced_buffer(std::size_t b) {
        return slots_[b].needs_buffer() ? slots_[b].buffer_data() : nullptr;
    }
    // Bucket b in this step, as its reduction works on it.
    [[nodiscard]] Step step_of(std::size_t b) {
        return Step{backend_, memory_, hooks_, slots_[b], b, finalizing_, unscale_};
    }

    // Bucket buffers and bookkeeping, beyond the model's own memory.
    [[nodiscard]] Bytes memory_held() const {
        Bytes total;
        for (const auto& buffer : lent_) total += Bytes{buffer.size()};
        for (const auto& s : slots_)
            total += Bytes{s.buffer.size() + s.widened.size() + s.segments.capacity() * sizeof(Segment) +
                           s.indices.capacity() * sizeof(std::size_t)};
        return total;
    }

private:
    void build(Slot& slot, const Bucket& bucket, std::span<const Parameter> params) {
        build_slot(slot, bucket, params, memory_,
                   ReductionRules{Hook::hooked, Wire, whole, backend_.size() > 1, /*lent=*/shared_ > 0});
    }

    // With shared buffers: bucket b borrows buffer b % n, where bucket b - n was kept.
    void lend_buffers() {
        lent_.clear();
        if (shared_ == 0) return;
        std::vector<std::size_t> largest(shared_, 0);
        for (std::size_t b = 0; b < slots_.size(); ++b)
            if (slots_[b].needs_buffer()) largest[b % shared_] = std::max(largest[b % shared_], slots_[b].count);
        for (const auto n : largest) lent_.push_back(memory_.allocate(Bytes{n * sizeof(float)}));
        for (std::size_t b = 0; b < slots_.size(); ++b)
            if (slots_[b].needs_buffer()) slots_[b].lent = Memory::data(lent_[b % shared_]);
    }

    // f(reduction, step) for bucket b's reduction.
    template <class F>
    void with_reduction(std::size_t b, F&& f) {
        auto step = step_of(b);
        std::visit([&](const auto& r) { f(r, step); }, slots_[b].reduction);
    }

    // A world of one: the local gradient is the average, so nothing is reduced (and no hook
    // runs); a shard is still packed where the front reads it, unless reduced in place.
    bool alone(std::size_t b) {
        if (backend_.size() > 1) return false;
        auto& slot = slots_[b];
        if constexpr (!whole)
            if (slot.needs_buffer()) memory_.pack(slot.table, slot.buffer_data());
        return true;
    }

    // After bucket b's collective completed: its reduction's pass.
    void finish(std::size_t b) {
        with_reduction(b, [](const auto& r, Step& s) { r.finish(s); });
    }

    BackendT& backend_;
    Memory memory_;
    HookRoute<BackendT, Hook> hooks_;
    std::vector<Slot> slots_;
    std::size_t shared_ = 0;                      // buffers lent in turn (share_buffers), 0: one per bucket
    std::vector<typename Memory::Storage> lent_;  // those buffers
    bool finalizing_ = false;
    double unscale_ = 1.0;
};

}  // namespace gradsync::inline v0::detail
