// ShardedDataParallel with its all-gathers behind the next forward
// (ShardedOptions::gather_behind_forward), on 2 ranks over the ResNet-50 and BERT-base layouts. A
// synthetic forward sleeps through its compute (as a host does while its GPU computes), each
// tensor's share by its parameters, in registration order, calling param_ready before it reads a
// tensor. Each iteration, both ranks together:
//   all-gather  step(), then wait_for_parameters() at once: the gathers with nothing to hide them
//   exposed     step(), then the forward: the time spent waiting in param_ready
// The forward's compute is the all-gather time over the comm/compute ratio (measured once before
// timing); exposed / all-gather is the share of the gathers the forward did not hide.
#include <gradsync/gradsync.hpp>

#include <benchmark/benchmark.h>

#include "layout_model.hpp"
#include "model_layouts.hpp"
#include "results.hpp"
#include "stats.hpp"
#include "two_ranks.hpp"

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Ratio {
    const char* label;
    double value;
};
constexpr Ratio comm_to_compute[] = {{"0.5", 0.5}, {"1", 1.0}};
constexpr int repetitions = 5;
constexpr double min_seconds = 0.3;

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

void gather_behind_forward(benchmark::State& state, std::vector<layouts::Tensor> (*layout)(), double ratio) {
    const auto tensors = layout();
    std::vector<double> fraction_before;  // of the forward's compute done before tensor i is read
    double done = 0;
    const auto total = static_cast<double>(layouts::total_count(tensors));
    for (const auto& t : tensors) {
        fraction_before.push_back(done / total);
        done += static_cast<double>(t.count);
    }
    std::vector<double> gather_s, exposed_s, ratios;
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        struct Replica {
            Replica(const std::vector<layouts::Tensor>& t, gradsync::LocalBackend& b)
                : model(t), sdp(model, b, gradsync::ShardedOptions{.gather_behind_forward = true}) {}
            bench::LayoutModel model;
            gradsync::ShardedDataParallel<bench::LayoutModel, gradsync::LocalBackend, gradsync::ShardedOptions> sdp;
        };
        auto r = std::make_shared<Replica>(tensors, b);
        auto step = [r] {
            (void)r->sdp.step([](std::span<const gradsync::ShardPiece<float>> pieces) {
                for (const auto& p : pieces)
                    for (std::size_t i = 0; i < p.params.size(); ++i) p.params[i] -= 1e-9f * p.grads[i];
            });
        };
        // The all-gathers alone, to set the compute budget (the same on both ranks: rank 0's).
        auto gather_alone = [r, step] {
            step();
            const auto t0 = clock_type::now();
            r->sdp.wait_for_parameters();
            return seconds_since(t0);
        };
        auto budget = std::make_shared<double>(0.0);
        for (int i = 0; i < 3; ++i) *budget = gather_alone();
        *budget /= ratio;
        b.broadcast(std::as_writable_bytes(std::span(budget.get(), 1)), 0);  // both forwards sleep alike
        const bool timer = b.rank() == 0;
        return [&, r, step, gather_alone, budget, timer, warm = false]() mutable {
            const double gather = gather_alone();
            step();
            const auto start = clock_type::now();
            double waited = 0;
            for (std::size_t i = 0; i < tensors.size(); ++i) {
                std::this_thread::sleep_until(
                    start + std::chrono::duration_cast<clock_type::duration>(
                                std::chrono::duration<double>(waited + *budget * fraction_before[i])));
                const auto t0 = clock_type::now();
                r->sdp.param_ready(i);
                waited += seconds_since(t0);
            }
            std::this_thread::sleep_until(start + std::chrono::duration_cast<clock_type::duration>(
                                                      std::chrono::duration<double>(waited + *budget)));
            if (timer && warm) {
                gather_s.push_back(gather);
                exposed_s.push_back(waited);
                ratios.push_back(waited / gather);
                state.SetIterationTime(gather + seconds_since(start));
            }
            warm = true;
        };
    });
    state.counters["gather_ms"] = bench::median(gather_s) * 1e3;
    state.counters["exposed_ms"] = bench::median(exposed_s) * 1e3;
    state.counters["ratio"] = bench::median(ratios);
}

void configure(benchmark::internal::Benchmark* b) { bench::timed_by_hand(b, repetitions, min_seconds); }

}  // namespace

namespace bench {

void register_gather_behind() {
    struct Layout {
        const char* name;
        std::vector<layouts::Tensor> (*tensors)();
    };
    for (auto layout : {Layout{"resnet50", layouts::resnet50}, Layout{"bert_base", layouts::bert_base}})
        for (const auto& ratio : comm_to_compute)
            benchmark::RegisterBenchmark(
                ("gather_behind_forward/" + std::string(layout.name) + "/comm_to_compute:" + ratio.label).c_str(),
                gather_behind_forward, layout.tensors, ratio.value)
                ->Apply(configure);
}

}  // namespace bench
