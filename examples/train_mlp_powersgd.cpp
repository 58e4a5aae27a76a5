// Trains the 784-512-10 MLP of mlp.hpp on synthetic data, printing the loss of every step.
#include "mlp.hpp"
#include <gradsync/gradsync.hpp>

#include <cstdio>

constexpr int steps = 20;
constexpr std::size_t batch = 32;  // examples per step and rank
constexpr int ranks = 4;

void train(gradsync::LocalBackend& backend) {
    mlp::Mlp model(/*seed=*/1);
    gradsync::DataParallel dp(model, backend, gradsync::PowerSGD({.rank = 4}));
    mlp::Sgd optimizer(/*lr=*/0.05f, /*momentum=*/0.9f);
    for (int step = 0; step < steps; ++step) {
        auto data = mlp::make_batch(/*seed=*/7, (step * ranks + backend.rank()) * batch, batch);
        float loss = model.forward_backward(data);
        dp.synchronize();
        optimizer.step(model);
        if (backend.rank() == 0) std::printf("step %2d  loss %.4f\n", step, loss);
    }
    const auto& hook = dp.comm_hook();
    if (backend.rank() == 0)
        std::printf("PowerSGD rank 4 sent %llu of %llu gradient values\n",
                    static_cast<unsigned long long>(hook.elements_sent()),
                    static_cast<unsigned long long>(hook.elements_reduced()));
}

int main() { gradsync::spawn(ranks, train); }
