// The PaddlePaddle manual's workflow in gradsync: a GradScaler-style dynamic loss scale and the
// learning rate scaled with the number of ranks (base_lr * num_gpus), on 4 ranks.
#include "mlp.hpp"
#include <gradsync/gradsync.hpp>

#include <cstdio>

constexpr int steps = 20;
constexpr std::size_t batch = 32;  // examples per step and rank
constexpr int ranks = 4;

void train(gradsync::LocalBackend& backend) {
    mlp::Mlp model(/*seed=*/1);
    mlp::Sgd optimizer(/*lr=*/0.0f, /*momentum=*/0.9f);
    // [amp]
    gradsync::DataParallel dp(model, backend,
                              gradsync::DynamicLossScale{.init_scale = 1024},  // GradScaler(init_loss_scaling=1024)
                              gradsync::LinearLr{.base_lr = 0.01, .micro_batch = batch},  // 0.01 * num_gpus
                              gradsync::Options{.clip_norm = 5.0});
    for (int step = 0; step < steps; ++step) {
        auto data = mlp::make_batch(/*seed=*/7, (step * ranks + backend.rank()) * batch, batch);
        float loss = model.forward_backward(data, /*grad_scale=*/dp.loss_scale());    // backward of loss * scale
        auto report = dp.step([&](double lr) { optimizer.step(model, float(lr)); });  // scaler.minimize(...)
        if (backend.rank() == 0)
            std::printf("step %2d  loss %.4f  lr %.3f  scale %.0f  grad norm %.3f%s\n", step, loss,
                        report.learning_rate, report.loss_scale, report.grad_norm, report.applied ? "" : "  skipped");
    }
    // [/amp]
}

int main() { gradsync::spawn(ranks, train); }
