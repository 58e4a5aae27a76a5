// What ShardedDataParallel's step decides over this rank's shards with the other ranks: the global
// norm and whether every averaged gradient is finite (one small allreduce), which parameters
// overflowed when one is not, and clipping, each pass over the shards through the memory policy;
// and the all-gather of the updated parameters, waited for at once or left in flight behind the
// next forward. Each collective carries its tag.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/data_parallel/finalize_step.hpp>
#include <gradsync/data_parallel/history.hpp>
#include <gradsync/data_parallel/shard_layout.hpp>
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
// when an element is). Where the shards are replicated (hybrid sharding), the first copy's ranks
// alone count toward the norm: every copy holds the same.
template <Backend B, class Layout>
ShardVerdict agree_on_shards(B& backend, Layout& shards, double unscale, CollectiveTag tag) {
    shards.memory().finalize(shards.grad_table(), nullptr, DType::float32, unscale, shards.result_slot());
    const double mine = shards.memory().results()[shards.result_slot()];
    const bool counts = replica(backend) == 0;
    double partial[2] = {std::isfinite(mine) && counts ? mine : 0.0, std::isfinite(mine) ? 0.0 : 1.0};
    if (backend.size() > 1) allreduce_tagged(backend, Buffer{partial, 2, DType::float64}, ReduceOp::sum, tag);
    if (partial[1] > 0) return {std::nan(""), false};
    return {std::sqrt(partial[0]), true};
}

// After an overflow, which every rank agreed on: the parameters with a non-finite averaged
// gradient in any rank's pieces, named alike on every rank (one allreduce of a flag each).
template <Backend B, class Layout>
std::vector<std::string> overflowed_parameters(B& backend, Layout& shards, std::span<const Parameter> params,
                                               CollectiveTag tag) {
    std::vector<float> flags(params.size(), 0.0f);
    const auto sums = shards.memory().segment_sums(shards.grad_table());
    for (std::size_t k = 0; k < shards.pieces.size(); ++k)
        if (!std::isfinite(sums[k])) flags[shards.pieces[k].parameter] = 1.0f;
    if (backend.size() > 1)
        allreduce_tagged(backend, Buffer{flags.data(), flags.size(), DType::float32}, ReduceOp::sum, tag);
    std::vector<std::string> names;
    for (std::size_t p = 0; p < flags.size(); ++p)
        if (flags[p] > 0) names.push_back(params[p].name);
    return names;
}

// The step's decision, the same on every rank: this rank's shards unscaled by the loss scale
// while their norm is measured, the scaler told the outcome, and then either the overflowed
// parameters named (report.applied false) or the shards clipped to `clip_norm` (above 0).
// tag_of(purpose) tags each collective.
template <Backend B, class Layout, class Scaler, class TagOf>
void decide_on_shards(B& backend, Layout& shards, std::span<const Parameter> params, Scaler& scaler, double clip_norm,
                      StepReport& report, TagOf&& tag_of) {
    report.loss_scale = scaler.scale();
    const auto verdict = agree_on_shards(backend, shards, 1.0 / static_cast<double>(report.loss_scale),
                                         tag_of(CollectivePurpose::step_decision));
    report.grad_norm = verdict.norm;
    report.applied = verdict.finite;
    scaler.update(!report.applied);  // every rank alike: the decision is agreed
    report.next_loss_scale = scaler.scale();
    if (!report.applied) {
        report.overflowed = overflowed_parameters(backend, shards, params, tag_of(CollectivePurpose::overflow_report));
    } else if (clip_norm > 0 && report.grad_norm > clip_norm) {
        // Scaled down so that the global norm becomes clip_norm.
        shards.memory().scale(shards.grad_table(), clip_norm / (report.grad_norm + 1e-6));
        report.clipped = true;
    }
}

// Bucket b's all-gather of the updated parameters, asynchronously: where they lie, or into its
// packed buffer.
template <Backend B, class Layout>
auto gather_async(B& backend, const Layout& shards, std::size_t b, CollectiveTag tag) {
    const auto& slot = shards.slots[b];
    if constexpr (Layout::in_place)
        return all_gather_async_tagged(backend, std::span<const Segment>(slot.param_segments), DType::float32, tag);
    else
        return all_gather_async_tagged(backend, Buffer{slot.buffer(), slot.count, DType::float32}, tag);
}

// optimizer(pieces) on this rank's shards; where the backend gathers packed buffers, the
// parameters are packed first, as the model holds them now.
template <class Layout, class Optimizer>
void update_shards(Layout& shards, Optimizer& optimizer) {
    if constexpr (!Layout::in_place)
        for (std::size_t b = 0; b < shards.slots.size(); ++b) shards.pack_shard(b);
    optimizer(std::span<const ShardPiece<float>>(shards.pieces));
}

// The shards updated, then every bucket's parameters all-gathered into every rank's model, where
// they lie or through the packed buffers; tag_of(b) tags bucket b's. On a device stream
// (StreamOrdered) the all-gathers follow the optimizer's kernels there, the stream waits for them
// and the unpacking is queued behind: the host waits for none of it.
template <Backend B, class Layout, class Optimizer, class TagOf>
void update_and_gather(B& backend, Layout& shards, Optimizer& optimizer, TagOf&& tag_of) {
    update_shards(shards, optimizer);
    const std::size_t buckets = shards.slots.size();
    for (std::size_t b = 0; b < buckets; ++b) {
        const auto& slot = shards.slots[b];
        if constexpr (Layout::in_place)
            all_gather_tagged(backend, std::span<const Segment>(slot.param_segments), DType::float32, tag_of(b));
        else if constexpr (StreamOrdered<B>)
            backend.wait_on_device(gather_async(backend, shards, b, tag_of(b)));
        else
            all_gather_tagged(backend, Buffer{slot.buffer(), slot.count, DType::float32}, tag_of(b));
    }
    if constexpr (!Layout::in_place)
        for (std::size_t b = 0; b < buckets; ++b) shards.unpack_params(b);
}

// The shards updated, then every bucket's all-gather launched in the order the forward reads
// them and left in flight with `gathers` (parameter_gathers.hpp), to be waited for per bucket.
template <Backend B, class Layout, class Optimizer, class Gathers, class TagOf>
void update_and_launch_gathers(B& backend, Layout& shards, Optimizer& optimizer, Gathers& gathers, TagOf&& tag_of) {
    update_shards(shards, optimizer);
    for (auto b : gathers.order()) gathers.launched(b, gather_async(backend, shards, b, tag_of(b)));
}

}  // namespace gradsync::inline v0::detail
