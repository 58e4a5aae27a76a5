// The data-parallel MLP trainer with communication overlapped with backward: the model reports
// each gradient as backward finishes it, and its bucket's allreduce starts right away.
#include "mlp.hpp"
#include <gradsync/gradsync.hpp>

#include <cstdio>

using namespace gradsync::literals;

constexpr int steps = 20;
constexpr std::size_t batch = 32;  // examples per step and rank
constexpr int ranks = 4;

void train(gradsync::LocalBackend& backend) {
    mlp::Mlp model(/*seed=*/1);
    // [overlap]
    gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{.cap = 1_MiB, .first_cap = 16_KiB});
    model.on_grad_ready = [&dp](std::size_t index) { dp.grad_ready(index); };  // the backward hook
    // [/overlap]
    mlp::Sgd optimizer(/*lr=*/0.05f, /*momentum=*/0.9f);
    for (int step = 0; step < steps; ++step) {
        auto data = mlp::make_batch(/*seed=*/7, (step * ranks + backend.rank()) * batch, batch);
        float loss = model.forward_backward(data);  // launches buckets as their gradients are ready
        dp.synchronize();                           // waits for the rest
        optimizer.step(model);
        if (backend.rank() == 0) std::printf("step %2d  loss %.4f\n", step, loss);
    }
}

int main() { gradsync::spawn(ranks, train); }
