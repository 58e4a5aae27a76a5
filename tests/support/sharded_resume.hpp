// The sharded resume test's training run, for any backend: the example MLP with Adam whose
// moments are split across the ranks (ShardedDataParallel) and checkpointed as shards.
// run(backend, caps, first, last, load, save) trains steps [first, last) on this rank, loading a
// checkpoint before when `load` is set and saving one after when `save` is set.
#pragma once

#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include "mlp.hpp"
#include "support/sharded_optimizers.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace sharded_resume {

namespace fs = std::filesystem;

constexpr int micro_batch = 8;
constexpr std::uint64_t data_seed = 91;

using Tensors = std::vector<std::vector<float>>;

// What one rank ends with: the weights, and its Adam moments placed at their elements in
// per-parameter arrays (zero where another rank owns them).
struct Outcome {
    Tensors weights;
    Tensors m1, m2;
    std::uint64_t steps = 0;
    int t = 0;
    float loss_scale = 0;  // for the next step
};

inline Tensors zeros_like(mlp::Mlp& m) {
    Tensors out;
    for (const auto& p : m.parameters()) out.emplace_back(p.count, 0.0f);
    return out;
}

// Trains steps [first, last) on this rank with Adam and a loss scale that doubles every second
// step, loading `load` before and saving to `save` after when given.
template <class Backend>
Outcome run(Backend& backend, gradsync::SizeCappedBuckets caps, int first, int last, const fs::path& load,
            const fs::path& save) {
    mlp::Mlp model(/*seed=*/5);
    gradsync::ShardedDataParallel sdp(model, backend, caps,
                                      gradsync::DynamicLossScale{.init_scale = 256.0f, .growth_interval = 2});
    sharded::ShardedAdam adam;
    adam.m1.assign(sdp.state_elements(), 0.0f);
    adam.m2.assign(sdp.state_elements(), 0.0f);
    gradsync::Checkpoint checkpoint;
    checkpoint.add_shard("adam.m1", std::span(adam.m1)).add_shard("adam.m2", std::span(adam.m2));
    checkpoint.add("adam.t", std::span(&adam.t, 1));
    if (!load.empty()) checkpoint.load(load, sdp);
    const int world = backend.size();
    for (int s = first; s < last; ++s) {
        model.forward_backward(
            mlp::make_batch(data_seed, static_cast<std::size_t>((s * world + backend.rank()) * micro_batch),
                            micro_batch),
            sdp.loss_scale());
        CHECK(sdp.step(adam).applied);
    }
    if (!save.empty()) checkpoint.save(save, sdp);
    Outcome out{{model.w1, model.b1, model.w2, model.b2},
                zeros_like(model),
                zeros_like(model),
                sdp.steps(),
                adam.t,
                sdp.loss_scale()};
    for (const auto& piece : sdp.shard_pieces())
        for (std::size_t i = 0; i < piece.params.size(); ++i) {
            out.m1[piece.parameter][piece.offset + i] = adam.m1[piece.state_offset + i];
            out.m2[piece.parameter][piece.offset + i] = adam.m2[piece.state_offset + i];
        }
    return out;
}

}  // namespace sharded_resume
