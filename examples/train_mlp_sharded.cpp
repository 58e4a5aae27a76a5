// Trains the 784-512-10 MLP of mlp.hpp on synthetic data, printing the loss of every step.
#include "mlp.hpp"
#include <gradsync/gradsync.hpp>

#include <cstdio>
#include <span>
#include <vector>

constexpr int steps = 20;
constexpr std::size_t batch = 32;  // examples per step and rank
constexpr int ranks = 4;

void train(gradsync::LocalBackend& backend) {
    mlp::Mlp model(/*seed=*/1);
    gradsync::ShardedDataParallel dp(model, backend);
    // SGD with momentum over this rank's shard: each rank keeps a quarter of the velocity.
    std::vector<float> velocity(dp.state_elements(), 0.0f);
    auto optimizer = [&](std::span<const gradsync::ShardPiece<float>> shard) {
        for (const auto& piece : shard)
            for (std::size_t i = 0; i < piece.params.size(); ++i) {
                float& v = velocity[piece.state_offset + i];
                v = /*momentum=*/0.9f * v + piece.grads[i];
                piece.params[i] -= /*lr=*/0.05f * v;
            }
    };
    for (int step = 0; step < steps; ++step) {
        auto data = mlp::make_batch(/*seed=*/7, (step * ranks + backend.rank()) * batch, batch);
        float loss = model.forward_backward(data);
        dp.step(optimizer);
        if (backend.rank() == 0) std::printf("step %2d  loss %.4f\n", step, loss);
    }
}

int main() { gradsync::spawn(ranks, train); }
