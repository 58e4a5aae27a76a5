// How ShardedDataParallel splits the plan's buckets among the ranks: each bucket into one
// contiguous shard per rank (shard_of), and this rank's shard of each into pieces, one per
// parameter it covers, pointing into the model (in place) or into packed bucket buffers (the
// bucket engine's, for the gradients, where the bucket was reduced packed or through a
// communication hook); with released gradients (stage 2), the pieces' gradients lie in a store of
// the wrapper's instead.
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/memory/host.hpp>
#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::sort, std::max, std::min
#include <cstddef>
#include <span>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0 {

// One contiguous piece of this rank's shard, within one parameter: its values and averaged
// gradients, which parameter (an index into ShardedDataParallel::parameters()) and from which of
// its elements, and where its optimizer state begins in the rank's state arrays of
// ShardedDataParallel::state_elements() elements. A rank owns at most one piece of a parameter.
template <class T>
struct ShardPiece {
    std::span<T> params;
    std::span<const T> grads;
    std::size_t state_offset = 0;
    std::size_t parameter = 0;
    std::size_t offset = 0;
};

namespace detail {

// The elements of this rank's shards of `plan`: the size of a stage-2 gradient store.
inline std::size_t shard_elements(const BucketPlan& plan, int ranks, int rank) {
    std::size_t n = 0;
    for (const auto& bucket : plan.buckets) n += shard_of(bucket.count, ranks, rank).count;
    return n;
}

// One bucket: its parameters where the model keeps them (by parameter index: the element order
// of the bucket), this rank's shard, and the parameter buffer when packed. Every copy goes
// through the memory policy, as a pack or unpack over one of its tables.
template <class Memory>
struct ShardSlot {
    std::vector<std::size_t> indices;       // the bucket's parameters, ascending
    std::vector<Segment> param_segments;    // float32, in that order
    typename Memory::Table param_table;     // param_segments
    typename Memory::Table shard_params;    // the parts of them in this rank's shard
    typename Memory::Table shard_grads;     // its averaged gradients, where stage 2 keeps them from
    typename Memory::Storage param_buffer;  // packed: the whole bucket's parameters
    std::size_t count = 0;
    Shard shard;
    std::size_t first_piece = 0, piece_count = 0;  // this rank's pieces of the bucket
    float* packed_grads = nullptr;                 // where the bucket was reduced packed, if it was

    [[nodiscard]] float* buffer() const { return reinterpret_cast<float*>(Memory::data(param_buffer)); }
    // The tables, from where `params` says the bucket's parameters and gradients lie; the
    // gradients' only where a store keeps them (stage 2): the shard of the packed buffer where the
    // bucket was reduced packed, else of the model's gradients.
    void build(const Memory& memory, std::span<const Parameter> params, bool keeps_grads) {
        param_segments.clear();
        for (auto i : indices) param_segments.push_back({params[i].data, params[i].count});
        const std::size_t lo = shard.offset, hi = lo + shard.count;
        param_table = memory.table(param_segments, DType::float32);
        shard_params = memory.table(segments_within(param_segments, lo, hi, DType::float32), DType::float32);
        if (!keeps_grads) return;
        std::vector<Segment> grads;
        if (packed_grads != nullptr) {
            if (hi > lo) grads.push_back({packed_grads + lo, hi - lo});
        } else {
            for (auto i : indices) grads.push_back({params[i].grad, params[i].count});
            grads = segments_within(grads, lo, hi, DType::float32);
        }
        shard_grads = memory.table(grads, DType::float32);
    }
};

// Every bucket's slot and this rank's pieces, in bucket order; the pieces' state offsets count
// up from 0 to state_elements. A `grad_store` of shard_elements() floats holds the pieces'
// gradients at their state offsets (stage 2); without one they lie in `packed_grads(b)`, where
// bucket b was reduced packed (null: where it lies), or else in the model's gradients. Memory:
// the memory policy where parameters and gradients lie: the bucket engine's, which outlives the
// layout; the step's decision measures the pieces into its `result_slot`, which no other pass
// writes.
template <bool InPlace, class Memory = HostMemory>
struct ShardLayout {
    static constexpr bool in_place = InPlace;
    std::vector<ShardSlot<Memory>> slots;
    std::vector<ShardPiece<float>> pieces;
    std::vector<std::span<float>> grads;  // the pieces' gradients, writable (unscaling, clipping)
    std::size_t state_elements = 0;

    ShardLayout() = default;
    template <class PackedGrads>
    ShardLayout(Memory& memory, std::size_t result_slot, std::span<const Parameter> params, const BucketPlan& plan,
                int ranks, int rank, PackedGrads&& packed_grads, float* grad_store = nullptr)
        : memory_(&memory), result_slot_(result_slot), grad_store_(grad_store) {
        for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
            const auto& bucket = plan.buckets[b];
            ShardSlot<Memory> slot;
            slot.indices = bucket.parameters;
            std::sort(slot.indices.begin(), slot.indices.end());
            slot.count = bucket.count;
            slot.shard = shard_of(bucket.count, ranks, rank);
            slot.first_piece = pieces.size();
            slot.packed_grads = packed_grads(b);
            slot.build(*memory_, params, grad_store_ != nullptr);
            if constexpr (!InPlace) slot.param_buffer = memory_->allocate(Bytes{bucket.count * sizeof(float)});
            // The shard crosses the bucket's parameters: one piece per parameter it covers.
            for_each_within(
                slot.param_segments, slot.shard.offset, slot.shard.offset + slot.shard.count,
                [&](std::size_t k, std::size_t from, std::size_t begin, std::size_t n) {
                    const std::size_t parameter = slot.indices[k];
                    float* p = InPlace ? static_cast<float*>(params[parameter].data) + from : slot.buffer() + begin;
                    float* g = grad_store_ != nullptr         ? grad_store_ + state_elements
                               : slot.packed_grads != nullptr ? slot.packed_grads + begin
                                                              : static_cast<float*>(params[parameter].grad) + from;
                    add_piece(p, g, n, parameter, from);
                });
            slot.piece_count = pieces.size() - slot.first_piece;
            slots.push_back(std::move(slot));  // the buffers' memory moves with it
        }
    }

    // Bucket b's storage moved to where `params` says: its tables, and in place its pieces,
    // follow.
    void refresh(std::size_t b, std::span<const Parameter> params) {
        auto& slot = slots[b];
        slot.build(*memory_, params, grad_store_ != nullptr);
        grads_moved_ = true;
        for (std::size_t j = slot.first_piece; j < slot.first_piece + slot.piece_count; ++j) {
            auto& piece = pieces[j];
            const auto& p = params[piece.parameter];
            if constexpr (InPlace) piece.params = {static_cast<float*>(p.data) + piece.offset, piece.params.size()};
            if (grad_store_ != nullptr || slot.packed_grads != nullptr) continue;  // they lie in the wrapper's memory
            grads[j] = {static_cast<float*>(p.grad) + piece.offset, piece.grads.size()};
            piece.grads = grads[j];
        }
    }

    // Packed: the model's parameters of this rank's shard copied into bucket b's parameter buffer.
    void pack_shard(std::size_t b) const {
        const auto& slot = slots[b];
        memory_->pack(slot.shard_params, reinterpret_cast<std::byte*>(slot.buffer() + slot.shard.offset));
    }
    // Packed: bucket b's gathered parameters copied into the model.
    void unpack_params(std::size_t b) const {
        memory_->unpack(slots[b].param_table, reinterpret_cast<const std::byte*>(slots[b].buffer()));
    }

    // Stage 2, once bucket b is reduced: its pieces' averaged gradients, copied from where the
    // reduce-scatter left them (the model's gradients, or a packed buffer lent to the bucket) into
    // the grad_store (where they lie one after another), where they outlive both.
    void keep_shard(std::size_t b) const {
        const auto& slot = slots[b];
        if (slot.piece_count == 0) return;
        memory_->pack(slot.shard_grads, reinterpret_cast<std::byte*>(grads[slot.first_piece].data()));
    }

    // The memory policy where the pieces lie, for the step's passes over them, and its result slot
    // for the decision.
    [[nodiscard]] Memory& memory() { return *memory_; }
    [[nodiscard]] std::size_t result_slot() const { return result_slot_; }
    // The pieces' gradients as one table of the memory policy (a segment per piece, in piece
    // order): the step's decision measures, unscales and clips them through it. Built at the first
    // use after they moved, so that storage followed during backward costs no table per bucket.
    [[nodiscard]] const typename Memory::Table& grad_table() {
        if (grads_moved_) {
            std::vector<Segment> segments;
            segments.reserve(grads.size());
            for (const auto g : grads) segments.push_back(Segment{g.data(), g.size()});
            grad_table_ = memory_->table(segments, DType::float32);
            grads_moved_ = false;
        }
        return grad_table_;
    }

private:
    void add_piece(float* params, float* g, std::size_t n, std::size_t parameter, std::size_t offset) {
        pieces.push_back(
            {std::span<float>(params, n), std::span<const float>(g, n), state_elements, parameter, offset});
        grads.emplace_back(g, n);
        state_elements += n;
    }

    Memory* memory_ = nullptr;
    std::size_t result_slot_ = 0;
    float* grad_store_ = nullptr;
    typename Memory::Table grad_table_;
    bool grads_moved_ = true;
};

}  // namespace detail
}  // namespace gradsync::inline v0
