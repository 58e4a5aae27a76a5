// Trains a small model on 2 ranks with StepMetrics in TensorBoard's format, and writes rank 0's
// step reports (and the loss it added) beside them as JSON lines: what read_metrics.py expects
// TensorBoard's own reader to find in the event file. Usage: write_metrics LOG_DIR EXPECTED_JSONL
#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/lr.hpp>
#include <gradsync/metrics/json_lines.hpp>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "../support/toy_model.hpp"

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s LOG_DIR EXPECTED_JSONL\n", argv[0]);
        return 2;
    }
    const std::string log_dir = argv[1];
    gradsync::JsonLinesFile expected(argv[2]);
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        testing_support::Toy model({1000, 30, 7}, 1.0f);
        gradsync::DataParallel dp(model, b, gradsync::DynamicLossScale{.init_scale = 256},
                                  gradsync::LinearLr{.base_lr = 0.05, .warmup_steps = 4},
                                  gradsync::StepMetrics{log_dir, gradsync::MetricsFormat::tensorboard});
        for (int step = 0; step < 6; ++step) {
            model.fill_grads(b.rank());
            // Step 4 overflows on rank 1: skipped on every rank, the scale halved.
            if (step == 3 && b.rank() == 1) model.tensors[1].g[2] = std::numeric_limits<float>::infinity();
            const double loss = 1.0 / (1.0 + step);
            dp.add_scalar("loss", loss);
            const auto r = dp.step([&](double lr) {
                for (auto& t : model.tensors)
                    for (std::size_t i = 0; i < t.w.size(); ++i) t.w[i] -= static_cast<float>(lr) * t.g[i];
            });
            if (b.rank() != 0) continue;
            static std::uint64_t skipped = 0;
            skipped += r.applied ? 0 : 1;
            const std::vector<gradsync::NamedScalar> values = {{"applied", r.applied ? 1.0 : 0.0},
                                                               {"loss_scale", r.loss_scale},
                                                               {"next_loss_scale", r.next_loss_scale},
                                                               {"skipped_steps", static_cast<double>(skipped)},
                                                               {"grad_norm", r.grad_norm},
                                                               {"clipped", r.clipped ? 1.0 : 0.0},
                                                               {"learning_rate", r.learning_rate},
                                                               {"overflowed", static_cast<double>(r.overflowed.size())},
                                                               {"step_seconds", r.step_seconds},
                                                               {"sync_seconds", r.sync_seconds},
                                                               {"bytes_reduced", static_cast<double>(r.bytes_reduced)},
                                                               {"loss", loss}};
            expected.write(r.step, values);
        }
        if (b.rank() == 0) std::printf("event file: %s\n", dp.metrics_path().c_str());
    });
    return 0;
}
