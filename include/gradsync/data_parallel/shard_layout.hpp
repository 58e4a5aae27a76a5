// How ShardedDataParallel splits the plan's buckets among the ranks: each bucket into one
// contiguous shard per rank (shard_of), and this rank's shard of each into pieces, one per
// parameter it covers, pointing into the model (in place) or into packed bucket buffers.
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/buffer.hpp>
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

// One bucket: its gradients and parameters where the model keeps them (by parameter index: the
// element order of the bucket), this rank's shard, and the packed route's buffers.
struct ShardSlot {
    std::vector<Segment> grads, params;
    std::vector<float> grad_buffer, param_buffer;
    Shard shard;

    void pack_grads() { copy_in(grads, grad_buffer); }
    void unpack_params() const {
        std::size_t at = 0;
        for (const auto& s : params) {
            std::memcpy(s.data, param_buffer.data() + at, s.count * sizeof(float));
            at += s.count;
        }
    }
    // Copies the model's parameters of this rank's shard into the parameter buffer.
    void pack_shard() {
        const std::size_t lo = shard.offset, hi = lo + shard.count;
        std::size_t at = 0;
        for (const auto& s : params) {
            const std::size_t begin = std::max(lo, at), end = std::min(hi, at + s.count);
            if (begin < end)
                std::memcpy(param_buffer.data() + begin, static_cast<const float*>(s.data) + (begin - at),
                            (end - begin) * sizeof(float));
            at += s.count;
        }
    }

private:
    static void copy_in(const std::vector<Segment>& segs, std::vector<float>& buffer) {
        std::size_t at = 0;
        for (const auto& s : segs) {
            std::memcpy(buffer.data() + at, s.data, s.count * sizeof(float));
            at += s.count;
        }
    }
};

// Every bucket's slot and this rank's pieces, in bucket order; the pieces' state offsets count
// up from 0 to state_elements.
template <bool InPlace>
struct ShardLayout {
    std::vector<ShardSlot> slots;
    std::vector<ShardPiece<float>> pieces;
    std::vector<std::span<float>> grads;  // the pieces' gradients, writable (unscaling, clipping)
    std::size_t state_elements = 0;

    ShardLayout() = default;
    ShardLayout(std::span<const Parameter> params, const BucketPlan& plan, int ranks, int rank) {
        for (const auto& bucket : plan.buckets) {
            ShardSlot slot;
            auto indices = bucket.parameters;
            std::sort(indices.begin(), indices.end());
            for (auto i : indices) {
                slot.grads.push_back({params[i].grad, params[i].count});
                slot.params.push_back({params[i].data, params[i].count});
            }
            if constexpr (!InPlace) {
                slot.grad_buffer.assign(bucket.count, 0.0f);
                slot.param_buffer.assign(bucket.count, 0.0f);
            }
            slot.shard = shard_of(bucket.count, ranks, rank);
            // The shard crosses the bucket's parameters: one piece per parameter it covers.
            const std::size_t lo = slot.shard.offset, hi = lo + slot.shard.count;
            std::size_t at = 0;
            for (std::size_t k = 0; k < slot.params.size(); ++k) {
                const std::size_t n = slot.params[k].count, begin = std::max(lo, at), end = std::min(hi, at + n);
                if (begin < end) {
                    float* p = InPlace ? static_cast<float*>(slot.params[k].data) + (begin - at)
                                       : slot.param_buffer.data() + begin;
                    float* g = InPlace ? static_cast<float*>(slot.grads[k].data) + (begin - at)
                                       : slot.grad_buffer.data() + begin;
                    add_piece(p, g, end - begin, indices[k], begin - at);
                }
                at += n;
            }
            slots.push_back(std::move(slot));  // the buffers' memory moves with it
        }
    }

private:
    void add_piece(float* params, float* g, std::size_t n, std::size_t parameter, std::size_t offset) {
        pieces.push_back(
            {std::span<float>(params, n), std::span<const float>(g, n), state_elements, parameter, offset});
        grads.emplace_back(g, n);
        state_elements += n;
    }
};

}  // namespace detail
}  // namespace gradsync::inline v0
