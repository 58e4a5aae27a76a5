// Trains the 784-512-10 MLP of mlp.hpp on synthetic data, printing the loss of every step.
#include "mlp.hpp"

#include <cstdio>

constexpr int steps = 20;
constexpr std::size_t batch = 32;  // examples per step

void train() {
    mlp::Mlp model(/*seed=*/1);
    mlp::Sgd optimizer(/*lr=*/0.05f, /*momentum=*/0.9f);
    for (int step = 0; step < steps; ++step) {
        auto data = mlp::make_batch(/*seed=*/7, step * batch, batch);
        float loss = model.forward_backward(data);
        optimizer.step(model);
        std::printf("step %2d  loss %.4f\n", step, loss);
    }
}

int main() { train(); }
