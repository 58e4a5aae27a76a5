// What ShardedDataParallel's step decides over this rank's shards with the other ranks: the global
// norm and whether every averaged gradient is finite (one small allreduce), which parameters
// overflowed when one is not, and clipping; and the all-gather of the updated parameters. Each
// collective carries its tag.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/data_parallel/finalize_step.hpp>
#include <gradsync/data_parallel/history.hpp>
#include <gradsync/data_parallel/shard_layout.hpp>
#include <gradsync/detail/host_passes.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/model/model.hpp>

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

struct ShardVerdict {
    double norm = 0;  // not finite when a gradient is not
    bool finite = true;
};

// Unscales this rank's shards by `unscale` (1: leaves them) while summing their squares, then
// agrees with every rank on the norm and the finite check (the square sum is non-finite exactly
// when an element is).
template <Backend B>
ShardVerdict agree_on_shards(B& backend, std::span<const std::span<float>> grads, double unscale, CollectiveTag tag) {
    SquareSum squares;
    for (const auto g : grads) {
        if (unscale == 1.0)
            square_sum(g.data(), g.size(), squares);
        else
            scale_square_sum(g.data(), g.size(), unscale, squares);
    }
    const double mine = squares.total();
    double partial[2] = {std::isfinite(mine) ? mine : 0.0, std::isfinite(mine) ? 0.0 : 1.0};
    if (backend.size() > 1) allreduce_tagged(backend, Buffer{partial, 2, DType::float64}, ReduceOp::sum, tag);
    if (partial[1] > 0) return {std::nan(""), false};
    return {std::sqrt(partial[0]), true};
}

// After an overflow, which every rank agreed on: the parameters with a non-finite averaged
// gradient in any rank's pieces, named alike on every rank (one allreduce of a flag each).
template <Backend B>
std::vector<std::string> overflowed_parameters(B& backend, std::span<const ShardPiece<float>> pieces,
                                               std::span<const Parameter> params, CollectiveTag tag) {
    std::vector<float> flags(params.size(), 0.0f);
    for (const auto& piece : pieces) {
        SquareSum squares;
        square_sum(piece.grads.data(), piece.grads.size(), squares);
        if (!std::isfinite(squares.total())) flags[piece.parameter] = 1.0f;
    }
    if (backend.size() > 1)
        allreduce_tagged(backend, Buffer{flags.data(), flags.size(), DType::float32}, ReduceOp::sum, tag);
    std::vector<std::string> names;
    for (std::size_t p = 0; p < flags.size(); ++p)
        if (flags[p] > 0) names.push_back(params[p].name);
    return names;
}

// Scales this rank's shards down so that the global norm `norm` becomes `clip_norm`.
inline void clip_shards(std::span<const std::span<float>> grads, double norm, double clip_norm) {
    for (const auto g : grads) scale_only(g.data(), g.size(), clip_norm / (norm + 1e-6));
}

// The step's decision, the same on every rank: this rank's shards unscaled by the loss scale
// while their norm is measured, the scaler told the outcome, and then either the overflowed
// parameters named (report.applied false) or the shards clipped to `clip_norm` (above 0).
// tag_of(purpose) tags each collective.
template <Backend B, bool InPlace, class Scaler, class TagOf>
void decide_on_shards(B& backend, const ShardLayout<InPlace>& shards, std::span<const Parameter> params, Scaler& scaler,
                      double clip_norm, StepReport& report, TagOf&& tag_of) {
    const auto grads = std::span<const std::span<float>>(shards.grads);
    report.loss_scale = scaler.scale();
    const auto verdict = agree_on_shards(backend, grads, 1.0 / static_cast<double>(report.loss_scale),
                                         tag_of(CollectivePurpose::step_decision));
    report.grad_norm = verdict.norm;
    report.applied = verdict.finite;
    scaler.update(!report.applied);  // every rank alike: the decision is agreed
    report.next_loss_scale = scaler.scale();
    if (!report.applied) {
        report.overflowed = overflowed_parameters(backend, std::span<const ShardPiece<float>>(shards.pieces), params,
                                                  tag_of(CollectivePurpose::overflow_report));
    } else if (clip_norm > 0 && report.grad_norm > clip_norm) {
        clip_shards(grads, report.grad_norm, clip_norm);
        report.clipped = true;
    }
}

// optimizer(pieces) on this rank's shards, then every bucket's parameters all-gathered into
// every rank's model, where they lie or through the packed buffers; tag_of(b) tags bucket b's.
template <Backend B, bool InPlace, class Optimizer, class TagOf>
void update_and_gather(B& backend, ShardLayout<InPlace>& shards, Optimizer& optimizer, TagOf&& tag_of) {
    if constexpr (!InPlace)
        for (auto& slot : shards.slots) slot.pack_shard();  // the parameters as the model holds them now
    optimizer(std::span<const ShardPiece<float>>(shards.pieces));
    for (std::size_t b = 0; b < shards.slots.size(); ++b) {
        auto& slot = shards.slots[b];
        if constexpr (InPlace)
            all_gather_tagged(backend, slot.params.segments, DType::float32, tag_of(b));
        else
            all_gather_tagged(backend, buffer_of(std::span<float>(slot.param_buffer)), tag_of(b));
    }
    if constexpr (!InPlace)
        for (auto& slot : shards.slots) slot.unpack_params();
}

}  // namespace gradsync::inline v0::detail
