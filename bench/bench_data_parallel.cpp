// DataParallel::synchronize() on 2 ranks over the gradient layouts of ResNet-50 and BERT-base,
// with no model behind them, against one raw allreduce of a flat buffer of the same bytes; and
// what the checks that protect a run cost beside it (the replica check, the listing of the model
// that follows moved gradient storage); and a step of ShardedDataParallel (optimizer state split
// across the ranks) against DataParallel's.
// The two alternate within every iteration, in alternating order, and the figure is the median
// of the per-iteration ratios: on a shared machine bandwidth drifts by tens of percent within
// seconds, so only ratios of interleaved measurements compare.
#include <gradsync/gradsync.hpp>

#include <benchmark/benchmark.h>

#include "layout_model.hpp"
#include "model_layouts.hpp"
#include "results.hpp"
#include "stats.hpp"
#include "two_ranks.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace {

// Knobs.
constexpr int repetitions = 5;
constexpr double min_seconds = 0.5;

// What one rank holds: the model, its DataParallel, and a flat buffer of the same bytes.
template <class... Policies>
struct Replica {
    Replica(const std::vector<layouts::Tensor>& t, gradsync::LocalBackend& b)
        : model(t), dp(model, b), flat(layouts::total_count(t), 1.0f) {}
    bench::LayoutModel model;
    gradsync::DataParallel<bench::LayoutModel, gradsync::LocalBackend, Policies...> dp;
    std::vector<float> flat;
};

template <class... Policies>
void synchronize_vs_flat(benchmark::State& state, std::vector<layouts::Tensor> (*layout)(), const std::string& key) {
    const auto tensors = layout();
    std::vector<double> flat_s, sync_s, ratios;
    gradsync::Bytes extra, grads;
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        auto replica = std::make_shared<Replica<Policies...>>(tensors, b);
        const bool timer = b.rank() == 0;
        if (timer) {
            extra = replica->dp.extra_memory() + b.memory_footprint();
            grads = replica->dp.gradient_bytes();
        }
        return [&, replica, &b = b, timer, flat_first = false, warmed_up = false]() mutable {
            auto flat = [&] { b.allreduce(std::span<float>(replica->flat), gradsync::ReduceOp::average); };
            auto sync = [&] { replica->dp.synchronize(); };
            auto [f, s] = bench::timed_pair(flat, sync, !flat_first);
            if (timer && warmed_up) {
                flat_s.push_back(f);
                sync_s.push_back(s);
                ratios.push_back(s / f);
                state.SetIterationTime(s);
            }
            flat_first = !flat_first;
            warmed_up = true;
        };
    });
    state.counters["flat_ms"] = bench::median(flat_s) * 1e3;
    state.counters["sync_ms"] = bench::median(sync_s) * 1e3;
    state.counters["ratio"] = bench::median(ratios);
    state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(grads.count()));
    bench::record_memory(key, extra, grads);
}

// check_replicas() (every rank hashes its parameters; one small allreduce compares the hashes)
// interleaved with synchronize(); and one listing of the model, which synchronize() makes to
// follow moved storage (once per step, and once per bucket launched during backward).
void replica_check_vs_synchronize(benchmark::State& state, std::vector<layouts::Tensor> (*layout)()) {
    const auto tensors = layout();
    std::vector<double> check_s, sync_s, ratios, list_s;
    double buckets = 0;
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        auto replica = std::make_shared<Replica<>>(tensors, b);
        const bool timer = b.rank() == 0;
        if (timer) buckets = static_cast<double>(replica->dp.plan().buckets.size());
        return [&, replica, timer, check_first = false, warmed_up = false]() mutable {
            auto check = [&] { replica->dp.check_replicas(); };
            auto sync = [&] { replica->dp.synchronize(); };
            auto [c, s] = bench::timed_pair(check, sync, !check_first);
            if (timer && warmed_up) {
                const auto t0 = std::chrono::steady_clock::now();
                benchmark::DoNotOptimize(gradsync::parameters(replica->model));
                list_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
                check_s.push_back(c);
                sync_s.push_back(s);
                ratios.push_back(c / s);
                state.SetIterationTime(c);
            }
            check_first = !check_first;
            warmed_up = true;
        };
    });
    state.counters["check_ms"] = bench::median(check_s) * 1e3;
    state.counters["sync_ms"] = bench::median(sync_s) * 1e3;
    state.counters["ratio"] = bench::median(ratios);
    state.counters["list_us"] = bench::median(list_s) * 1e6;
    state.counters["buckets"] = buckets;
}

// One optimizer step, plain SGD, on 2 ranks: DataParallel::step (allreduce, then the optimizer over
// every parameter) against ShardedDataParallel::step (reduce_scatter, the optimizer over this
// rank's shard, all_gather), interleaved; and the optimizer state each keeps per array.
void sharded_vs_unsharded_step(benchmark::State& state, std::vector<layouts::Tensor> (*layout)()) {
    const auto tensors = layout();
    std::vector<double> sharded_s, unsharded_s, ratios;
    double state_sharded = 0, state_unsharded = 0;
    constexpr float lr = 1e-6f;
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        struct Replicas {
            Replicas(const std::vector<layouts::Tensor>& t, gradsync::LocalBackend& b)
                : plain(t), split(t), dp(plain, b), sdp(split, b) {}
            bench::LayoutModel plain, split;
            gradsync::DataParallel<bench::LayoutModel, gradsync::LocalBackend> dp;
            gradsync::ShardedDataParallel<bench::LayoutModel, gradsync::LocalBackend> sdp;
        };
        auto r = std::make_shared<Replicas>(tensors, b);
        const bool timer = b.rank() == 0;
        if (timer) {
            state_sharded = static_cast<double>(r->sdp.state_elements() * sizeof(float));
            state_unsharded = static_cast<double>(r->sdp.parameter_elements() * sizeof(float));
        }
        return [&, r, timer, sharded_first = false, warm = false]() mutable {
            auto unsharded = [&] {
                (void)r->dp.step([&] {
                    for (const auto& p : r->dp.parameters()) {
                        auto* w = static_cast<float*>(p.data);
                        const auto* g = static_cast<const float*>(p.grad);
                        for (std::size_t i = 0; i < p.count; ++i) w[i] -= lr * g[i];
                    }
                });
            };
            auto sharded = [&] {
                (void)r->sdp.step([&](std::span<const gradsync::ShardPiece<float>> pieces) {
                    for (const auto& p : pieces)
                        for (std::size_t i = 0; i < p.params.size(); ++i) p.params[i] -= lr * p.grads[i];
                });
            };
            auto [sh, un] = bench::timed_pair(sharded, unsharded, !sharded_first);
            if (timer && warm) {
                sharded_s.push_back(sh);
                unsharded_s.push_back(un);
                ratios.push_back(sh / un);
                state.SetIterationTime(sh);
            }
            sharded_first = !sharded_first;
            warm = true;
        };
    });
    state.counters["sharded_ms"] = bench::median(sharded_s) * 1e3;
    state.counters["unsharded_ms"] = bench::median(unsharded_s) * 1e3;
    state.counters["ratio"] = bench::median(ratios);
    state.counters["state_bytes_sharded"] = state_sharded;
    state.counters["state_bytes_unsharded"] = state_unsharded;
}

void configure(benchmark::internal::Benchmark* b) {
    b->UseManualTime()
        ->Repetitions(bench::repetitions_of(repetitions))
        ->ReportAggregatesOnly(true)
        ->MinTime(bench::min_seconds_of(min_seconds));
    b->Unit(benchmark::kMillisecond);
}

}  // namespace

namespace bench {

void register_data_parallel() {
    struct Layout {
        const char* name;
        std::vector<layouts::Tensor> (*tensors)();
    };
    for (auto layout : {Layout{"resnet50", layouts::resnet50}, Layout{"bert_base", layouts::bert_base}}) {
        std::string name = layout.name;
        benchmark::RegisterBenchmark(("synchronize_vs_flat/" + name + "/in_place").c_str(), synchronize_vs_flat<>,
                                     layout.tensors, name + "/in_place")
            ->Apply(configure);
        benchmark::RegisterBenchmark(("synchronize_vs_flat/" + name + "/packed").c_str(),
                                     synchronize_vs_flat<gradsync::PackedBuckets>, layout.tensors, name + "/packed")
            ->Apply(configure);
        benchmark::RegisterBenchmark(("replica_check/" + name).c_str(), replica_check_vs_synchronize, layout.tensors)
            ->Apply(configure);
        benchmark::RegisterBenchmark(("sharded_step/" + name).c_str(), sharded_vs_unsharded_step, layout.tensors)
            ->Apply(configure);
    }
}

}  // namespace bench
