// DataParallel::synchronize() on 2 ranks over the gradient layouts of ResNet-50 and BERT-base,
// with no model behind them, against one raw allreduce of a flat buffer of the same bytes; and
// what the checks that protect a run cost beside it (the replica check, the listing of the model
// that follows moved gradient storage); a step of ShardedDataParallel (optimizer state split
// across the ranks) against DataParallel's; and its stage 2 (gradients released once reduced)
// against stage 1: peak gradient memory and step time.
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
#include <type_traits>  // for std::conditional_t
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

// A layout model whose backward makes each gradient when it reaches it (last tensor first, a few
// passes of arithmetic standing in for the compute), calls grad_ready, and frees gradients when
// told to: what stage 2 needs. Counts the gradient bytes it holds and their peak in a step.
class MakingModel {
public:
    explicit MakingModel(const std::vector<layouts::Tensor>& tensors) : tensors_(tensors) {
        for (const auto& t : tensors) values_.emplace_back(t.count, 0.5f);
        grads_.resize(tensors.size());
    }
    std::vector<gradsync::Parameter> parameters() {
        for (std::size_t i = 0; i < grads_.size(); ++i) make(i);
        return parameters_now();
    }
    std::vector<gradsync::Parameter> parameters_now() {
        std::vector<gradsync::Parameter> out;
        for (std::size_t i = 0; i < tensors_.size(); ++i)
            out.push_back(gradsync::parameter(tensors_[i].name, values_[i].data(),
                                              grads_[i].empty() ? nullptr : grads_[i].data(), tensors_[i].count));
        return out;
    }
    void release_gradients(std::span<const std::size_t> indices) {
        for (auto i : indices) {
            held_ -= grads_[i].size() * sizeof(float);
            std::vector<float>().swap(grads_[i]);
        }
    }
    template <class Ready>
    void backward(Ready&& ready) {
        peak_ = held_;
        for (std::size_t i = grads_.size(); i-- > 0;) {
            make(i);
            auto& g = grads_[i];
            for (int pass = 0; pass < 3; ++pass)
                for (std::size_t k = 0; k < g.size(); ++k) g[k] = g[k] * 0.5f + values_[i][k];
            ready(i);
        }
    }
    [[nodiscard]] std::size_t peak() const { return peak_; }

private:
    void make(std::size_t i) {
        if (!grads_[i].empty()) return;
        grads_[i].assign(tensors_[i].count, 0.0f);
        held_ += grads_[i].size() * sizeof(float);
        peak_ = std::max(peak_, held_);
    }
    std::vector<layouts::Tensor> tensors_;
    std::vector<std::vector<float>> values_, grads_;
    std::size_t held_ = 0, peak_ = 0;
};

// LocalBackend with only its collectives over one buffer: the buckets are reduced as packed
// copies, as the device backends reduce them.
struct PackedOnly {
    gradsync::LocalBackend& b;
    int rank() const { return b.rank(); }
    int size() const { return b.size(); }
    bool supports(gradsync::DType t) const { return b.supports(t); }
    void allreduce(gradsync::Buffer buf, gradsync::ReduceOp op) { b.allreduce(buf, op); }
    template <class T>
    void allreduce(std::span<T> s, gradsync::ReduceOp op) {
        b.allreduce(gradsync::buffer_of(s), op);
    }
    auto allreduce_async(gradsync::Buffer buf, gradsync::ReduceOp op) { return b.allreduce_async(buf, op); }
    void broadcast(std::span<std::byte> bytes, int root) { b.broadcast(bytes, root); }
    void barrier() { b.barrier(); }
    void reduce_scatter(gradsync::Buffer buf, gradsync::ReduceOp op) { b.reduce_scatter(buf, op); }
    auto reduce_scatter_async(gradsync::Buffer buf, gradsync::ReduceOp op) { return b.reduce_scatter_async(buf, op); }
    void all_gather(gradsync::Buffer buf) { b.all_gather(buf); }
    auto all_gather_async(gradsync::Buffer buf) { return b.all_gather_async(buf); }
};

// Backward and a sharded step (plain SGD) on 2 ranks, overlapped through grad_ready: stage 1
// (the model keeps every gradient) against stage 2 (release_gradients), interleaved; the peak of
// gradient memory per rank in a step, the model's and the wrapper's together (its bucket buffers
// included), and the step times. `Packed`: over PackedOnly, where stage 2 lends its buckets three
// gradient buffers in turn.
template <bool Packed>
void released_gradients(benchmark::State& state, std::vector<layouts::Tensor> (*layout)()) {
    const auto tensors = layout();
    std::vector<double> kept_s, released_s, ratios;
    double peak_kept = 0, peak_released = 0;
    constexpr float lr = 1e-6f;
    using B = std::conditional_t<Packed, PackedOnly, gradsync::LocalBackend>;
    using Sharded = gradsync::ShardedDataParallel<MakingModel, B, gradsync::ShardedOptions>;
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        struct Replicas {
            Replicas(const std::vector<layouts::Tensor>& t, gradsync::LocalBackend& b)
                : packed{b},
                  keeping(t),
                  releasing(t),
                  stage1(keeping, backend(b)),
                  stage2(releasing, backend(b), {.release_gradients = true}) {}
            B& backend(gradsync::LocalBackend& b) {
                if constexpr (Packed)
                    return packed;
                else
                    return b;
            }
            PackedOnly packed;
            MakingModel keeping, releasing;
            Sharded stage1, stage2;
        };
        auto r = std::make_shared<Replicas>(tensors, b);
        const bool timer = b.rank() == 0;
        return [&, r, timer, released_first = false, warm = false]() mutable {
            auto train = [&](MakingModel& model, Sharded& sdp) {
                return [&] {
                    model.backward([&](std::size_t i) { sdp.grad_ready(i); });
                    (void)sdp.step([&](std::span<const gradsync::ShardPiece<float>> pieces) {
                        for (const auto& p : pieces)
                            for (std::size_t i = 0; i < p.params.size(); ++i) p.params[i] -= lr * p.grads[i];
                    });
                };
            };
            auto [re, ke] =
                bench::timed_pair(train(r->releasing, r->stage2), train(r->keeping, r->stage1), !released_first);
            if (timer && warm) {
                released_s.push_back(re);
                kept_s.push_back(ke);
                ratios.push_back(re / ke);
                state.SetIterationTime(re);
                peak_kept =
                    std::max(peak_kept, static_cast<double>(r->keeping.peak() + r->stage1.extra_memory().count()));
                peak_released = std::max(peak_released,
                                         static_cast<double>(r->releasing.peak() + r->stage2.extra_memory().count()));
            }
            released_first = !released_first;
            warm = true;
        };
    });
    state.counters["released_ms"] = bench::median(released_s) * 1e3;
    state.counters["kept_ms"] = bench::median(kept_s) * 1e3;
    state.counters["ratio"] = bench::median(ratios);
    state.counters["peak_grad_bytes_released"] = peak_released;
    state.counters["peak_grad_bytes_kept"] = peak_kept;
}

void configure(benchmark::internal::Benchmark* b) { bench::timed_by_hand(b, repetitions, min_seconds); }

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
        benchmark::RegisterBenchmark(("released_gradients/" + name).c_str(), released_gradients<false>, layout.tensors)
            ->Apply(configure);
        benchmark::RegisterBenchmark(("released_gradients/" + name + "/packed").c_str(), released_gradients<true>,
                                     layout.tensors)
            ->Apply(configure);
    }
}

}  // namespace bench
