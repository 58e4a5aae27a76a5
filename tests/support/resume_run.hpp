// The resume test's training run, for any backend: the example MLP with SGD with momentum, a
// dynamic loss scale that moves within the run, a warming-up LR and a shuffling sampler.
// run_steps(backend, first, last, load, save) trains steps [first, last) on this rank, loading
// a checkpoint before when `load` is set and saving one after when `save` is set, and returns
// the weights: 10 steps straight must equal 5, save, a new group, load, 5 more, bit for bit.
#pragma once

#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/gradsync.hpp>

#include "mlp.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace resume {

// SGD with momentum whose velocity is public, so that a checkpoint can hold it.
struct MomentumSgd {
    explicit MomentumSgd(mlp::Mlp& m) {
        for (const auto& p : m.parameters()) velocity.emplace_back(p.count, 0.0f);
    }
    void step(mlp::Mlp& m, float lr) {
        auto params = m.parameters();
        for (std::size_t p = 0; p < params.size(); ++p) {
            auto* w = static_cast<float*>(params[p].data);
            auto* g = static_cast<const float*>(params[p].grad);
            for (std::size_t i = 0; i < velocity[p].size(); ++i) {
                velocity[p][i] = 0.9f * velocity[p][i] + g[i];
                w[i] -= lr * velocity[p][i];
            }
        }
    }
    std::vector<std::vector<float>> velocity;
};

inline constexpr std::size_t dataset = 32;  // a few steps per epoch: the resumed run starts mid-epoch
inline constexpr int micro_batch = 4;

// The examples at `indices`, as one batch.
inline mlp::Batch gather(const std::vector<std::size_t>& indices, std::size_t first, int count) {
    mlp::Batch b;
    b.size = count;
    for (int k = 0; k < count; ++k) {
        auto one = mlp::make_batch(11, indices[first + std::size_t(k)], 1);
        b.images.insert(b.images.end(), one.images.begin(), one.images.end());
        b.labels.push_back(one.labels[0]);
    }
    return b;
}

inline std::vector<float> flat(const mlp::Mlp& m) {
    std::vector<float> all;
    for (const auto* v : {&m.w1, &m.b1, &m.w2, &m.b2}) all.insert(all.end(), v->begin(), v->end());
    return all;
}

struct Outcome {
    std::vector<float> weights;
    std::vector<float> velocity0;
    float loss_scale = 0;
    std::uint64_t steps = 0;
    std::uint64_t epoch = 0;
};

template <class Backend>
Outcome run_steps(Backend& backend, int first, int last, const std::string& load, const std::string& save) {
    mlp::Mlp model(1 + std::uint64_t(backend.rank()) * 1000 + std::uint64_t(first) * 7);  // all overwritten
    gradsync::DataParallel dp(model, backend, gradsync::DynamicLossScale{.init_scale = 1024, .growth_interval = 3},
                              gradsync::LinearLr{.base_lr = 0.02, .micro_batch = micro_batch, .warmup_steps = 6});
    MomentumSgd opt(model);
    gradsync::ShardedSampler sampler(dataset, backend.size(), backend.rank(), {.seed = first == 0 ? 5u : 99u});
    gradsync::Checkpoint checkpoint;
    for (std::size_t p = 0; p < opt.velocity.size(); ++p)
        checkpoint.add("optimizer.velocity." + std::to_string(p), std::span(opt.velocity[p]));
    checkpoint.add(sampler);
    if (!load.empty()) checkpoint.load(load, dp);
    const std::size_t per_epoch = sampler.size() / micro_batch;
    for (int s = first; s < last; ++s) {
        const auto within = std::size_t(s) % per_epoch;
        if (within == 0) sampler.set_epoch(std::size_t(s) / per_epoch);
        model.forward_backward(gather(sampler.indices(), within * micro_batch, micro_batch), dp.loss_scale());
        dp.step([&](double lr) { opt.step(model, float(lr)); });
    }
    if (!save.empty()) checkpoint.save(save, dp);
    return Outcome{flat(model), opt.velocity[0], dp.loss_scale(), dp.steps(), sampler.epoch()};
}

}  // namespace resume
