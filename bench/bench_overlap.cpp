// Overlap of communication with backward, on 2 ranks over the ResNet-50 and BERT-base layouts.
// A synthetic backward sleeps (as a host does while its GPU computes) until each layer's
// gradients are due, its share of the compute time proportional to its parameters, in reverse
// registration order, and calls grad_ready for them. Per layout and comm/compute ratio, every
// plan runs in the same benchmark, interleaved step by step, so that all of them meet the same
// machine (a 2-core VM's memory bandwidth drifts by a third between runs a minute apart): fixed
// caps (a sweep) beside the autotuned plan (given its first steps to choose). Each iteration
// measures, each part starting together on both ranks, in an order that rotates:
//   compute        the backward alone
//   sequential     the backward, then synchronize() of the default plan (no grad_ready: nothing
//                  overlaps)
//   overlapped     per plan, the backward calling grad_ready as each tensor is done, then
//                  synchronize()
//   last bucket    per plan, one allreduce of its last bucket's bytes, alone
// exposed = overlapped - compute is the communication the overlap did not hide; plan bound is what
// the bucket plan lets even a perfect engine hide (a bucket cannot start before it is complete
// and its predecessor done), so exposed - plan bound is the engine's own cost; floor is the least
// plan bound of any plan (a bucket per layer). Counters are per plan, "<cap>.<figure>", beside the
// shared compute_ms, comm_ms, sequential_ms and floor_ms. Also here: gradients as bucket views
// against pack/unpack copies, for backends that need contiguous buffers.
#include <gradsync/gradsync.hpp>

#include <benchmark/benchmark.h>

#include "layout_model.hpp"
#include "model_layouts.hpp"
#include "results.hpp"
#include "stats.hpp"
#include "two_ranks.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

// Knobs.
constexpr double comm_to_compute[] = {0.25, 0.5, 1.0, 2.0};
// Fixed caps, filled forward: PyTorch DDP's and a sweep of finer ones; a negative cap is its size
// with SizeCappedBuckets::growing; 0 is the default plan with Options::autotune_buckets, tuned
// over its first steps.
constexpr int ddp_cap_mib = 25;
constexpr int default_cap_mib = -8;  // SizeCappedBuckets{}
constexpr int bucket_caps_mib[] = {ddp_cap_mib, 8, 2, default_cap_mib, 0};
constexpr int overlap_iterations = 12;  // timed, after one that warms up
// Overlapped steps before timing an autotuned plan: enough for both of its choices.
constexpr int tuning_steps = 3 * gradsync::detail::BucketTuner::steps_per_round;
constexpr int view_repetitions = 5;
constexpr double view_min_seconds = 0.5;

using clock_type = std::chrono::steady_clock;
using gradsync::Bytes;

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

// cap 0: the default plan, autotuned; else fixed caps, growing along backward when negative.
gradsync::SizeCappedBuckets caps_of(int cap_mib) {
    if (cap_mib == 0) return {};
    if (cap_mib == default_cap_mib) {
        const gradsync::SizeCappedBuckets defaults;
        if (defaults.cap != Bytes{8u << 20} || !defaults.growing) std::abort();  // the label "8grow" would lie
        return defaults;
    }
    return {.cap = Bytes{std::uint64_t(std::abs(cap_mib)) << 20}, .first_cap = Bytes{1u << 20}, .growing = cap_mib < 0};
}

std::string cap_label(int cap_mib) {
    if (cap_mib == 0) return "auto";
    return std::to_string(std::abs(cap_mib)) + (cap_mib < 0 ? "grow" : "");
}

// A synthetic backward's layers: modules (a tensor's name without ".weight" or ".bias"), which
// backward finishes in reverse order, each when its share of the compute (by parameters) has
// passed, reporting all of its tensors then.
struct Layer {
    std::vector<std::size_t> tensors;
    double fraction = 0;  // of the compute done when this layer is
    double share = 0;     // of the parameters, so of the compute and of the communication
};

std::vector<Layer> backward_layers(const std::vector<layouts::Tensor>& tensors) {
    std::vector<Layer> layers;
    double total = static_cast<double>(layouts::total_count(tensors)), done = 0;
    auto module = [&](std::size_t i) { return tensors[i].name.substr(0, tensors[i].name.rfind('.')); };
    for (std::size_t end = tensors.size(); end > 0;) {
        std::size_t begin = end - 1;
        while (begin > 0 && module(begin - 1) == module(end - 1)) --begin;
        Layer layer;
        for (std::size_t i = end; i-- > begin;) {
            done += static_cast<double>(tensors[i].count);
            layer.share += static_cast<double>(tensors[i].count) / total;
            layer.tensors.push_back(i);
        }
        layer.fraction = done / total;
        layers.push_back(std::move(layer));
        end = begin;
    }
    return layers;
}

// The least exposure any plan leaves a perfect engine: every layer its own bucket, sent the
// moment backward finishes it (a finer plan cannot send a layer sooner; a coarser one waits).
// Where communication matches compute it is the largest layer's share of the communication.
double any_plan_bound(const std::vector<Layer>& layers, double compute, double comm) {
    double done = 0;
    for (const auto& layer : layers) done = std::max(done, compute * layer.fraction) + comm * layer.share;
    return std::max(0.0, done - compute);
}

// One rank's replica of the model under one bucket plan.
struct OverlapReplica {
    OverlapReplica(const std::vector<layouts::Tensor>& tensors, const std::vector<Layer>& l, gradsync::LocalBackend& b,
                   int cap_mib, std::string timeline = {})
        : model(tensors),
          dp(model, b, caps_of(cap_mib), gradsync::Options{.autotune_buckets = cap_mib == 0, .timeline = timeline}),
          backend(b),
          layers(l),
          cap(cap_mib) {
        read_plan();
    }

    // The median time of synchronize() without overlap, agreed on (rank 0's) by both ranks: the
    // communication the compute budget follows from.
    double measure_comm() {
        std::vector<double> plain;
        for (int k = 0; k < 5; ++k) {
            backend.barrier();
            auto t = clock_type::now();
            dp.synchronize();
            plain.push_back(seconds_since(t));
        }
        double comm = bench::median(plain);
        backend.broadcast(std::span<double>(&comm, 1), 0);
        return comm;
    }

    // The plan's last bucket and when each bucket is due (again after autotuning changed it).
    void read_plan() {
        double total = 0;
        for (const auto& bucket : dp.plan().buckets) total += static_cast<double>(bucket.count);
        last_bucket.assign(dp.plan().buckets.back().count, 1.0f);
        std::vector<double> due_fraction(dp.parameters().size());
        for (const auto& layer : layers)
            for (auto i : layer.tensors) due_fraction[i] = layer.fraction;
        bucket_ready_fraction.clear();
        bucket_share.clear();
        for (const auto& bucket : dp.plan().buckets) {
            double ready = 0;
            for (auto p : bucket.parameters) ready = std::max(ready, due_fraction[p]);
            bucket_ready_fraction.push_back(ready);
            bucket_share.push_back(double(bucket.count) / total);
        }
    }

    // Lets autotuning choose its plan with this backend's compute time.
    void tune(double compute) {
        for (int k = 0; k < tuning_steps; ++k) {
            backend.barrier();
            backward(compute, true);
            dp.synchronize();
        }
        read_plan();
    }

    // Sleeps through the backward of `compute` seconds, reporting each layer if `overlap`.
    void backward(double compute, bool overlap) {
        const auto start = clock_type::now();
        for (const auto& layer : layers) {
            std::this_thread::sleep_until(start + std::chrono::duration_cast<clock_type::duration>(
                                                      std::chrono::duration<double>(compute * layer.fraction)));
            if (overlap)
                for (auto i : layer.tensors) dp.grad_ready(i);
        }
    }

    // The exposure this plan allows even to a perfect engine: bucket k's allreduce starts when it
    // is ready and its predecessor is done, and takes its share of the communication.
    [[nodiscard]] double plan_bound(double compute, double comm) const {
        double done = 0;
        for (std::size_t k = 0; k < bucket_share.size(); ++k)
            done = std::max(done, compute * bucket_ready_fraction[k]) + comm * bucket_share[k];
        return std::max(0.0, done - compute);
    }

    bench::LayoutModel model;
    gradsync::DataParallel<bench::LayoutModel, gradsync::LocalBackend, gradsync::SizeCappedBuckets, gradsync::Options>
        dp;
    gradsync::LocalBackend& backend;
    const std::vector<Layer>& layers;  // in backward order
    int cap = 0;                       // as caps_of takes it
    std::vector<float> last_bucket;
    std::vector<double> bucket_ready_fraction, bucket_share;  // per bucket, in launch order
};

// The plans of one layout and ratio: the sweep's caps, and in a quick run the default plan,
// DDP's and autotuning alone.
std::vector<int> plans_measured() {
    std::vector<int> caps;
    for (int cap : bucket_caps_mib)
        if (!bench::quick() || cap == 0 || cap == ddp_cap_mib || cap == default_cap_mib) caps.push_back(cap);
    return caps;
}

void overlap(benchmark::State& state, std::vector<layouts::Tensor> (*layout)(), double ratio) {
    const auto tensors = layout();
    const auto layers = backward_layers(tensors);
    const auto caps = plans_measured();
    const std::size_t plans = caps.size();
    struct PlanFigures {
        std::vector<double> overlapped, last_bucket;  // samples, seconds
        double plan_bound = 0, buckets = 0, cap_kib = 0, first_cap_kib = 0;
    };
    std::vector<PlanFigures> figures(plans);
    std::vector<double> compute_s, sequential_s;
    double comm = 0;
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        auto replicas = std::make_shared<std::vector<std::unique_ptr<OverlapReplica>>>();
        std::size_t reference = 0;  // the default plan, untuned: the one whose communication sets the budget
        for (std::size_t k = 0; k < plans; ++k) {
            replicas->push_back(std::make_unique<OverlapReplica>(tensors, layers, b, caps[k]));
            if (caps[k] == default_cap_mib) reference = k;
        }
        const double c = (*replicas)[reference]->measure_comm(), budget = c / ratio;
        for (auto& r : *replicas)
            if (r->cap == 0) r->tune(budget);
        const bool timer = b.rank() == 0;
        if (timer) {
            comm = c;
            for (std::size_t k = 0; k < plans; ++k) {
                const auto& r = *(*replicas)[k];
                figures[k].plan_bound = r.plan_bound(budget, c);
                figures[k].buckets = static_cast<double>(r.dp.plan().buckets.size());
                figures[k].cap_kib = static_cast<double>(r.dp.bucketer().cap.count()) / 1024;
                figures[k].first_cap_kib = static_cast<double>(r.dp.bucketer().first_cap.count()) / 1024;
            }
        }
        // Parts of an iteration: 0 compute, 1 sequential, then per plan its overlapped step and
        // its last bucket.
        return [&, replicas, reference, budget, timer, iteration = 0]() mutable {
            const std::size_t parts = 2 + 2 * plans;
            double default_overlapped = 0;
            for (std::size_t k = 0; k < parts; ++k) {
                const std::size_t part = (k + static_cast<std::size_t>(iteration)) % parts;  // rotate
                auto& r = *(*replicas)[part < 2 ? reference : (part - 2) / 2];
                r.backend.barrier();
                auto t = clock_type::now();
                if (part == 0) {
                    r.backward(budget, false);
                } else if (part == 1) {
                    r.backward(budget, false);
                    r.dp.synchronize();
                } else if (part % 2 == 0) {
                    r.backward(budget, true);
                    r.dp.synchronize();
                } else {
                    r.backend.allreduce(std::span<float>(r.last_bucket), gradsync::ReduceOp::average);
                }
                const double s = seconds_since(t);
                if (!timer || iteration == 0) continue;  // iteration 0 warms up
                auto& f = figures[part < 2 ? 0 : (part - 2) / 2];
                (part == 0       ? compute_s
                 : part == 1     ? sequential_s
                 : part % 2 == 0 ? f.overlapped
                                 : f.last_bucket)
                    .push_back(s);
                if (part >= 2 && part % 2 == 0 && r.cap == 0) default_overlapped = s;
            }
            if (timer && iteration > 0) state.SetIterationTime(default_overlapped);
            ++iteration;
        };
    });
    const double c = bench::median(compute_s);
    state.counters["comm_ms"] = comm * 1e3;
    state.counters["compute_ms"] = c * 1e3;
    state.counters["sequential_ms"] = bench::median(sequential_s) * 1e3;
    state.counters["floor_ms"] = any_plan_bound(layers, comm / ratio, comm) * 1e3;
    for (std::size_t k = 0; k < plans; ++k) {
        const auto& f = figures[k];
        const std::string p = cap_label(caps[k]) + ".";
        const double o = bench::median(f.overlapped);
        state.counters[p + "overlapped_ms"] = o * 1e3;
        state.counters[p + "exposed_ms"] = (o - c) * 1e3;
        state.counters[p + "last_bucket_ms"] = bench::median(f.last_bucket) * 1e3;
        state.counters[p + "plan_bound_ms"] = f.plan_bound * 1e3;
        state.counters[p + "buckets"] = f.buckets;
        if (caps[k] == 0) {
            state.counters[p + "cap_kib"] = f.cap_kib;
            state.counters[p + "first_cap_kib"] = f.first_cap_kib;
        }
    }
}

// The autotuned ResNet-50 plan at comm/compute 0.5 as a Chrome trace (Options::timeline), for the
// summary's plot of one step: where GRADSYNC_BENCH_RESULTS points, if it does. Apart from the
// timed configurations, whose steps the trace would slow.
void timeline(benchmark::State& state) {
    const char* dir = std::getenv("GRADSYNC_BENCH_RESULTS");
    const std::string path = dir != nullptr ? std::string(dir) + "/timeline_resnet50.json" : std::string();
    const auto tensors = layouts::resnet50();
    const auto layers = backward_layers(tensors);
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        auto r = std::make_shared<OverlapReplica>(tensors, layers, b, 0, path);
        const double budget = r->measure_comm() / 0.5;
        r->tune(budget);
        return [r, budget] {
            r->backend.barrier();
            r->backward(budget, true);
            r->dp.synchronize();
        };
    });
}

// synchronize() with a contiguous-only path (PackedBuckets): per-tensor buffers are packed and
// unpacked; one blob makes every bucket a view. Interleaved; ratio = copy / view.
void views(benchmark::State& state, std::vector<layouts::Tensor> (*layout)()) {
    const auto tensors = layout();
    std::vector<double> copy_s, view_s, ratios;
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        struct Replicas {
            Replicas(const std::vector<layouts::Tensor>& t, gradsync::LocalBackend& b)
                : separate(t), blob(t), copies(separate, b), views(blob, b) {}
            bench::LayoutModel separate;
            bench::BlobModel blob;
            gradsync::DataParallel<bench::LayoutModel, gradsync::LocalBackend, gradsync::PackedBuckets> copies;
            gradsync::DataParallel<bench::BlobModel, gradsync::LocalBackend, gradsync::PackedBuckets> views;
        };
        auto r = std::make_shared<Replicas>(tensors, b);
        const bool timer = b.rank() == 0;
        return [&, r, timer, view_first = false, warm = false]() mutable {
            auto [c, v] =
                bench::timed_pair([&] { r->copies.synchronize(); }, [&] { r->views.synchronize(); }, view_first);
            if (timer && warm) {
                view_s.push_back(v);
                copy_s.push_back(c);
                ratios.push_back(c / v);
                state.SetIterationTime(v);
            }
            view_first = !view_first;
            warm = true;
        };
    });
    state.counters["copy_ms"] = bench::median(copy_s) * 1e3;
    state.counters["view_ms"] = bench::median(view_s) * 1e3;
    state.counters["copy_over_view"] = bench::median(ratios);
}

}  // namespace

namespace bench {

void register_overlap() {
    struct Layout {
        const char* name;
        std::vector<layouts::Tensor> (*tensors)();
    };
    for (auto layout : {Layout{"resnet50", layouts::resnet50}, Layout{"bert_base", layouts::bert_base}}) {
        for (double ratio : comm_to_compute) {
            if (bench::quick() && ratio != 1.0) continue;  // quick: where communication matches compute
            std::string name =
                std::string("overlap/") + layout.name + "/comm_to_compute:" + std::to_string(ratio).substr(0, 4);
            benchmark::RegisterBenchmark(name.c_str(), overlap, layout.tensors, ratio)
                ->UseManualTime()
                ->Iterations(bench::iterations_of(overlap_iterations))
                ->Unit(benchmark::kMillisecond);
        }
    }
    benchmark::RegisterBenchmark("overlap_timeline/resnet50", timeline)->Iterations(1)->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("views_vs_copies/resnet50", views, layouts::resnet50)
        ->UseManualTime()
        ->Repetitions(bench::repetitions_of(view_repetitions))
        ->ReportAggregatesOnly(true)
        ->MinTime(bench::min_seconds_of(view_min_seconds))
        ->Unit(benchmark::kMillisecond);
}

}  // namespace bench
