// What the training scalars cost per step, on 2 ranks of a small model (256 KiB of gradients in
// 16 tensors: a step short enough for a per-step cost to show). Four wrappers of four copies of
// the model on one backend, each iteration timing one step of each, in a rotating order:
//   plain        synchronize(), then the optimizer: no report at all
//   off          step(optimizer) with NoMetrics (the default): the report, its times and bytes
//   json         step() with StepMetrics writing JSON lines
//   tensorboard  step() with StepMetrics writing TensorBoard events
// json / off and tensorboard / off are what writing costs. What step() adds for the report when
// metrics are off (the optimizer timed, the report's times and bytes filled, the writer's no-op)
// is timed alone, 100,000 times, and set beside the off step: the share of a step it takes.
#include <gradsync/gradsync.hpp>

#include <benchmark/benchmark.h>

#include "layout_model.hpp"
#include "model_layouts.hpp"
#include "results.hpp"
#include "stats.hpp"
#include "two_ranks.hpp"

#include <unistd.h>  // for getpid

#include <array>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int repetitions = 5;
constexpr double min_seconds = 0.3;

using clock_type = std::chrono::steady_clock;

std::vector<layouts::Tensor> small_layout() {
    std::vector<layouts::Tensor> tensors;
    for (int k = 0; k < 16; ++k) tensors.push_back({"layer" + std::to_string(k) + ".weight", 4096});
    return tensors;
}

void sgd(bench::LayoutModel& model) {
    for (auto p : model.parameters()) {
        auto* w = static_cast<float*>(p.data);
        const auto* g = static_cast<const float*>(p.grad);
        for (std::size_t i = 0; i < p.count; ++i) w[i] -= 1e-6f * g[i];
    }
}

void metrics_cost(benchmark::State& state) {
    const auto tensors = small_layout();
    const auto dir = std::filesystem::temp_directory_path() / ("gradsync_bench_metrics_" + std::to_string(getpid()));
    std::array<std::vector<double>, 4> times;  // rank 0's, per variant, after the warm-up
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        using Model = bench::LayoutModel;
        using Backend = gradsync::LocalBackend;
        struct Replicas {
            Replicas(const std::vector<layouts::Tensor>& t, Backend& b, const std::filesystem::path& dir)
                : m{Model(t), Model(t), Model(t), Model(t)},
                  plain(m[0], b),
                  off(m[1], b),
                  json(m[2], b, gradsync::StepMetrics{(dir / "metrics.jsonl").string()}),
                  tensorboard(m[3], b,
                              gradsync::StepMetrics{(dir / "tb").string(), gradsync::MetricsFormat::tensorboard}) {}
            std::array<Model, 4> m;
            gradsync::DataParallel<Model, Backend> plain, off;
            gradsync::DataParallel<Model, Backend, gradsync::StepMetrics> json, tensorboard;
        };
        if (b.rank() == 0) std::filesystem::create_directories(dir);
        b.barrier();
        auto r = std::make_shared<Replicas>(tensors, b, dir);
        const bool timer = b.rank() == 0;
        return [&, r, timer, round = std::size_t{0}]() mutable {
            const auto run = [&](std::size_t variant) {
                const auto t0 = clock_type::now();
                switch (variant) {
                    case 0:
                        r->plain.synchronize();
                        sgd(r->m[0]);
                        break;
                    case 1: (void)r->off.step([&] { sgd(r->m[1]); }); break;
                    case 2:
                        r->json.add_scalar("loss", 0.5);
                        (void)r->json.step([&] { sgd(r->m[2]); });
                        break;
                    default: r->tensorboard.add_scalar("loss", 0.5); (void)r->tensorboard.step([&] { sgd(r->m[3]); });
                }
                return std::chrono::duration<double>(clock_type::now() - t0).count();
            };
            double total = 0;
            for (std::size_t k = 0; k < 4; ++k) {
                const std::size_t variant = (round + k) % 4;
                const double s = run(variant);
                total += s;
                if (timer && round >= (bench::quick() ? 1u : 4u)) times[variant].push_back(s);
            }
            ++round;
            if (timer) state.SetIterationTime(total);
        };
    });
    const double plain = bench::median(times[0]);
    state.counters["plain_us"] = plain * 1e6;
    state.counters["off_us"] = bench::median(times[1]) * 1e6;
    state.counters["json_us"] = bench::median(times[2]) * 1e6;
    state.counters["tensorboard_us"] = bench::median(times[3]) * 1e6;
    state.counters["off_over_plain"] = bench::median(times[1]) / plain;
    state.counters["json_over_plain"] = bench::median(times[2]) / plain;
    state.counters["tensorboard_over_plain"] = bench::median(times[3]) / plain;
    // What metrics off add to a step: the same calls step() makes for its report.
    constexpr int added_calls = 100000;
    gradsync::detail::StepClock clock;
    gradsync::detail::StepMetricsLog<gradsync::NoMetrics> log;
    gradsync::StepReport report;
    int optimizer_runs = 0;
    const auto t0 = clock_type::now();
    for (int i = 0; i < added_calls; ++i) {
        const auto began = clock_type::now();
        auto optimizer = [&] { ++optimizer_runs; };
        gradsync::detail::TimedOptimizer timed(optimizer);
        timed();
        clock.fill(report, began, timed.seconds(), static_cast<std::uint64_t>(i));
        log.write(report);
        benchmark::DoNotOptimize(report);
    }
    const double added = std::chrono::duration<double>(clock_type::now() - t0).count() / added_calls;
    benchmark::DoNotOptimize(optimizer_runs);
    state.counters["added_ns"] = added * 1e9;
    state.counters["added_over_off"] = added / bench::median(times[1]);
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
}

}  // namespace

namespace bench {

void register_metrics() {
    benchmark::RegisterBenchmark("metrics_cost/small_model", metrics_cost)
        ->Apply([](benchmark::internal::Benchmark* b) { timed_by_hand(b, repetitions, min_seconds); });
}

}  // namespace bench
