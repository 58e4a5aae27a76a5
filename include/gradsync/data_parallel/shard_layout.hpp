// How ShardedDataParallel splits the plan's buckets among the ranks: each bucket into one
// contiguous shard per rank (shard_of), and this rank's shard of each into pieces, one per
// parameter it covers, pointing into the model (in place) or into packed bucket buffers (the
// bucket engine's, for the gradients, where the bucket was reduced packed or through a
// communication hook); with released gradients (stage 2), the pieces' gradients lie in a store of
// the wrapper's instead.
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/memory/host.hpp>
#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::sort, std::max, std::min
#include <cstddef>
#include <cstring>  // for std::memcpy
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

// One bucket: its parameters where the model keeps them (by parameter index: the element order
// of the bucket), this rank's shard, and the parameter buffer when packed.
struct ShardSlot {
    std::vector<std::size_t> indices;  // the bucket's parameters, ascending
    HostMemory::Table params;          // float32 segments, in that order
    std::vector<float> param_buffer;
    Shard shard;
    std::size_t first_piece = 0, piece_count = 0;  // this rank's pieces of the bucket
    float* packed_grads = nullptr;                 // where the bucket was reduced packed, if it was

    void unpack_params() const { HostMemory{}.unpack(params, reinterpret_cast<const std::byte*>(param_buffer.data())); }
    // Copies the model's parameters of this rank's shard into the parameter buffer.
    void pack_shard() {
        const std::size_t lo = shard.offset, hi = lo + shard.count;
        std::size_t at = 0;
        for (const auto& s : params.segments) {
            const std::size_t begin = std::max(lo, at), end = std::min(hi, at + s.count);
            if (begin < end)
                std::memcpy(param_buffer.data() + begin, static_cast<const float*>(s.data) + (begin - at),
                            (end - begin) * sizeof(float));
            at += s.count;
        }
    }
};

// Every bucket's slot and this rank's pieces, in bucket order; the pieces' state offsets count
// up from 0 to state_elements. A `grad_store` of shard_elements() floats holds the pieces'
// gradients at their state offsets (stage 2); without one they lie in `packed_grads(b)`, where
// bucket b was reduced packed (null: where it lies), or else in the model's gradients.
template <bool InPlace>
struct ShardLayout {
    std::vector<ShardSlot> slots;
    std::vector<ShardPiece<float>> pieces;
    std::vector<std::span<float>> grads;  // the pieces' gradients, writable (unscaling, clipping)
    std::size_t state_elements = 0;

    ShardLayout() = default;
    template <class PackedGrads>
    ShardLayout(std::span<const Parameter> params, const BucketPlan& plan, int ranks, int rank,
                PackedGrads&& packed_grads, float* grad_store = nullptr)
        : grad_store_(grad_store) {
        for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
            const auto& bucket = plan.buckets[b];
            ShardSlot slot;
            slot.indices = bucket.parameters;
            std::sort(slot.indices.begin(), slot.indices.end());
            const auto& indices = slot.indices;
            slot.first_piece = pieces.size();
            slot.packed_grads = packed_grads(b);
            for (auto i : indices) slot.params.segments.push_back({params[i].data, params[i].count});
            if constexpr (!InPlace) slot.param_buffer.assign(bucket.count, 0.0f);
            slot.shard = shard_of(bucket.count, ranks, rank);
            // The shard crosses the bucket's parameters: one piece per parameter it covers.
            const std::size_t lo = slot.shard.offset, hi = lo + slot.shard.count;
            std::size_t at = 0;
            for (std::size_t k = 0; k < slot.params.segments.size(); ++k) {
                const std::size_t n = slot.params.segments[k].count, begin = std::max(lo, at),
                                  end = std::min(hi, at + n);
                if (begin < end) {
                    float* p = InPlace ? static_cast<float*>(slot.params.segments[k].data) + (begin - at)
                                       : slot.param_buffer.data() + begin;
                    float* g = grad_store_ != nullptr ? grad_store_ + state_elements
                               : slot.packed_grads != nullptr
                                   ? slot.packed_grads + begin
                                   : static_cast<float*>(params[indices[k]].grad) + (begin - at);
                    add_piece(p, g, end - begin, indices[k], begin - at);
                }
                at += n;
            }
            slot.piece_count = pieces.size() - slot.first_piece;
            slots.push_back(std::move(slot));  // the buffers' memory moves with it
        }
    }

    // The elements of this rank's shards of `plan`: the size of a grad_store.
    static std::size_t shard_elements(const BucketPlan& plan, int ranks, int rank) {
        std::size_t n = 0;
        for (const auto& bucket : plan.buckets) n += shard_of(bucket.count, ranks, rank).count;
        return n;
    }

    // Bucket b's storage moved to where `params` says: its segments, and in place its pieces,
    // follow.
    void refresh(std::size_t b, std::span<const Parameter> params) {
        auto& slot = slots[b];
        for (std::size_t k = 0; k < slot.indices.size(); ++k) {
            const auto& p = params[slot.indices[k]];
            slot.params.segments[k] = {p.data, p.count};
        }
        for (std::size_t j = slot.first_piece; j < slot.first_piece + slot.piece_count; ++j) {
            auto& piece = pieces[j];
            const auto& p = params[piece.parameter];
            if constexpr (InPlace) piece.params = {static_cast<float*>(p.data) + piece.offset, piece.params.size()};
            if (grad_store_ != nullptr || slot.packed_grads != nullptr) continue;  // they lie in the wrapper's memory
            grads[j] = {static_cast<float*>(p.grad) + piece.offset, piece.grads.size()};
            piece.grads = grads[j];
        }
    }

    // Stage 2, once bucket b is reduced in place: its pieces' averaged gradients, copied from the
    // model into the grad_store, where they outlive the model's gradients.
    void keep_shard(std::size_t b, std::span<const Parameter> params) {
        const auto& slot = slots[b];
        for (std::size_t j = slot.first_piece; j < slot.first_piece + slot.piece_count; ++j) {
            const auto& piece = pieces[j];
            std::memcpy(grads[j].data(), static_cast<const float*>(params[piece.parameter].grad) + piece.offset,
                        grads[j].size() * sizeof(float));
        }
    }

private:
    void add_piece(float* params, float* g, std::size_t n, std::size_t parameter, std::size_t offset) {
        pieces.push_back(
            {std::span<float>(params, n), std::span<const float>(g, n), state_elements, parameter, offset});
        grads.emplace_back(g, n);
        state_elements += n;
    }

    float* grad_store_ = nullptr;
};

}  // namespace detail
}  // namespace gradsync::inline v0
