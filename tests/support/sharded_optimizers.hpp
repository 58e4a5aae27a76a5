// The example's optimizers (mlp::Sgd, mlp::Adam) over the shard pieces ShardedDataParallel
// hands them: the same float operations per element, the state indexed by each piece's
// state_offset, so that sharded training ends bitwise where unsharded training does.
#pragma once

#include <gradsync/sharded_data_parallel.hpp>

#include <cmath>
#include <span>
#include <vector>

namespace sharded {

using Pieces = std::span<const gradsync::ShardPiece<float>>;

struct ShardedSgd {
    float lr = 0.05f, momentum = 0.9f;
    std::vector<float> velocity;
    void operator()(Pieces pieces) {
        for (const auto& p : pieces)
            for (std::size_t i = 0; i < p.params.size(); ++i) {
                float& v = velocity.at(p.state_offset + i);
                v = momentum * v + p.grads[i];
                p.params[i] -= lr * v;
            }
    }
};
struct ShardedAdam {
    float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
    std::vector<float> m1, m2;
    int t = 0;
    void operator()(Pieces pieces) {
        ++t;
        const float c1 = 1 - std::pow(beta1, float(t)), c2 = 1 - std::pow(beta2, float(t));
        for (const auto& p : pieces)
            for (std::size_t i = 0; i < p.params.size(); ++i) {
                const std::size_t k = p.state_offset + i;
                const float g = p.grads[i];
                m1.at(k) = beta1 * m1[k] + (1 - beta1) * g;
                m2.at(k) = beta2 * m2[k] + (1 - beta2) * g * g;
                p.params[i] -= lr * (m1[k] / c1) / (std::sqrt(m2[k] / c2) + eps);
            }
    }
};

}  // namespace sharded
