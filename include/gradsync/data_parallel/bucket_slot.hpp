// BucketSlot: one bucket's storage in the bucket engine and the state of its collective in the
// current step, and the way it is reduced (bucket_reductions.hpp), chosen when it is built
// (build_slot).
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/data_parallel/bucket_reductions.hpp>
#include <gradsync/data_parallel/hook_route.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/model/model.hpp>
#include <gradsync/reduction/comm_hook.hpp>

#include <algorithm>  // for std::sort
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>  // for std::is_same_v
#include <variant>
#include <vector>

namespace gradsync::inline v0::detail {

// The first k whose segment does not start where segment k - 1 ends; 0 when they all follow each
// other in memory.
inline std::size_t first_gap(std::span<const Segment> segs, DType t) {
    const std::size_t elem = size_of(t);
    for (std::size_t k = 1; k < segs.size(); ++k)
        if (static_cast<const std::byte*>(segs[k - 1].data) + segs[k - 1].count * elem != segs[k].data) return k;
    return 0;
}

// Whether variant V has alternative R.
template <class R, class V>
inline constexpr bool has_alternative = false;
template <class R, class... A>
inline constexpr bool has_alternative<R, std::variant<A...>> = (std::is_same_v<R, A> || ...);

// Memory: the memory policy (its Table and Storage); Handle: the backend's asynchronous collective;
// Reductions: the ways the engine's buckets may be reduced (BucketReductions), its plain one first.
template <class Memory, class Handle, class Reductions>
struct BucketSlot {
    using clock = std::chrono::steady_clock;
    std::vector<Segment> segments;     // its gradients, by parameter index
    std::vector<std::size_t> indices;  // their parameters
    std::optional<Segment> view;       // set when they lie contiguously
    Reductions reduction;
    DType dtype = DType::float32;          // the gradients'
    DType wire = DType::float32;           // what the collective moves
    std::size_t count = 0;                 // elements
    typename Memory::Table table;          // the segments, as the memory policy's passes take them
    bool measured = false;                 // finalized this step: its result slot is current
    typename Memory::Storage buffer;       // packed or compressed (world > 1), or a hook's float32 copy
    std::byte* lent = nullptr;             // instead, one of the engine's shared buffers (BucketEngine::share_buffers)
    typename Memory::Storage widened;      // a float32 copy, made once when a compressed sum overflowed
    typename Memory::Table float32_table;  // a hook's float32 copy of 16-bit gradients (the buffer)
    std::optional<Handle> handle;
    std::optional<HookComm::Pending> pending;  // the hook's collectives in flight
    std::vector<HookParameter> hooked;         // the parameters, as the hook sees them
    std::int64_t hook_step = 0;                // the step the hook started in
    clock::time_point launched_at, finished_at;

    // Whether the bucket is reduced by R.
    template <class R>
    [[nodiscard]] bool reduced_by() const {
        if constexpr (has_alternative<R, Reductions>)
            return std::holds_alternative<R>(reduction);
        else
            return false;
    }
    // Whether its reduction needs a buffer beside its gradients (where it then leaves its result).
    [[nodiscard]] bool needs_buffer() const {
        return std::visit([this](const auto& r) { return r.needs_buffer(*this); }, reduction);
    }
    // Where its buffer lies: its own, or the one the engine lends it.
    [[nodiscard]] std::byte* buffer_data() const { return lent != nullptr ? lent : Memory::data(buffer); }
    [[nodiscard]] bool by_hook() const { return reduced_by<HookReduction>(); }
    // A hook's 16-bit bucket, widened into a float32 copy (the buffer).
    [[nodiscard]] bool widened_for_hook() const { return reduced_by<HookReduction>() && wire != dtype; }
    // The bucket (number `index` in the plan) as the hook sees it, apart from its values.
    [[nodiscard]] HookedBucket hooked_bucket(std::size_t index) const {
        return HookedBucket{index, hooked, indices, dtype};
    }
};

// What decides how a bucket is reduced besides the bucket itself and the engine's reductions.
struct ReductionRules {
    bool hooked = false;          // a communication hook takes the float32 and 16-bit buckets
    DType wire = DType::float32;  // not float32: float32 buckets are compressed to it
    bool whole = true;            // allreduced; false: reduce-scattered, the shard read from the buffer
    bool peers = true;            // a world of more than one: buffers for the collective
    bool lent = false;            // the engine lends buffers: none of the bucket's own
};

// (Re)builds `slot` for `bucket`: its segments, in parameter order (the element layout every
// rank shares), its reduction, its memory policy table, and its buffer where the reduction needs
// one (kept when it has one: a rebuild after the gradients moved keeps the packed buffer).
template <class Memory, class Handle, class Reductions>
void build_slot(BucketSlot<Memory, Handle, Reductions>& slot, const Bucket& bucket, std::span<const Parameter> params,
                Memory& memory, const ReductionRules& rules) {
    slot.indices = bucket.parameters;
    std::sort(slot.indices.begin(), slot.indices.end());
    slot.segments.clear();
    for (auto i : slot.indices) slot.segments.push_back(Segment{params[i].grad, params[i].count});
    slot.dtype = slot.wire = bucket.dtype;
    slot.count = bucket.count;
    const bool contiguous = first_gap(slot.segments, bucket.dtype) == 0;
    slot.view.reset();
    slot.hooked.clear();
    const bool half = bucket.dtype == DType::float16 || bucket.dtype == DType::bfloat16;
    // A hook sees float32 values: a half bucket is widened into a float32 buffer (never a view).
    // A shard is read where the front was told it lies: the packed buffer.
    if (contiguous && !(rules.hooked && half) && rules.whole)
        slot.view = Segment{slot.segments.front().data, slot.count};
    slot.reduction = std::variant_alternative_t<0, Reductions>{};  // the engine's plain way
    if (rules.hooked && (bucket.dtype == DType::float32 || half)) {
        slot.reduction = HookReduction{};
        slot.wire = DType::float32;
        std::size_t offset = 0;
        for (auto i : slot.indices) {
            slot.hooked.push_back(HookParameter{params[i].name, offset, params[i].count, params[i].shape});
            offset += params[i].count;
        }
    } else if constexpr (has_alternative<WireAllreduce, Reductions>) {
        if (rules.wire != DType::float32 && bucket.dtype == DType::float32) {
            slot.reduction = WireAllreduce{};
            slot.wire = rules.wire;
        }
    }
    slot.table = memory.table(slot.segments, bucket.dtype);
    // A hook's float32 copy is kept in a world of one too (float32_gradient() reads it), and a
    // shard is read from the buffer.
    const bool kept = slot.widened_for_hook() || !rules.whole;
    if (slot.needs_buffer() && (rules.peers || kept) && !rules.lent && slot.buffer.size() == 0)
        slot.buffer = memory.allocate(Bytes{slot.count * size_of(slot.wire)});
    if (slot.widened_for_hook()) {
        const Segment whole{slot.buffer_data(), slot.count};
        slot.float32_table = memory.table(std::span<const Segment>(&whole, 1), DType::float32);
    }
}

}  // namespace gradsync::inline v0::detail
