// The example MLP as one "model shard" of a larger job, for the tests of backends over groups of
// ranks: each shard its own model and data (its own seeds), trained by one process on the whole
// batch of its replicas as the reference, and how far two sets of weights lie apart.
#pragma once

#include "mlp.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradsync_test {

using Weights = std::vector<std::vector<float>>;
inline Weights weights_of(const mlp::Mlp& m) { return {m.w1, m.b1, m.w2, m.b2}; }

inline std::uint64_t model_seed(int shard) { return 1 + 77 * static_cast<std::uint64_t>(shard); }
inline std::uint64_t data_seed(int shard) { return 2026 + static_cast<std::uint64_t>(shard); }

// Shard `shard` trained `steps` steps of SGD with momentum by one process on the whole batch of
// `replicas` ranks of `micro_batch` each (rank r's samples r * micro_batch ... of each step).
inline Weights train_one_process(int shard, int replicas, int steps, int micro_batch) {
    mlp::Mlp model(model_seed(shard));
    mlp::Sgd opt(0.05f, 0.9f);
    const int global = replicas * micro_batch;
    for (int s = 0; s < steps; ++s) {
        model.forward_backward(mlp::make_batch(data_seed(shard), static_cast<std::size_t>(s * global), global));
        opt.step(model);
    }
    return weights_of(model);
}

// ||a - b|| / ||b|| over all tensors.
inline double relative_difference(const Weights& a, const Weights& b) {
    double diff = 0, norm = 0;
    for (std::size_t t = 0; t < b.size(); ++t)
        for (std::size_t i = 0; i < b[t].size(); ++i) {
            const double d = double(a[t][i]) - double(b[t][i]);
            diff += d * d;
            norm += double(b[t][i]) * double(b[t][i]);
        }
    return std::sqrt(diff / norm);
}

}  // namespace gradsync_test
