// Mixed precision. The fused finalize pass (unscale, non-finite check, sum of squares) on one
// rank's gradients, beside memcpy of the same bytes and the unfused sequence of passes every peer
// runs (average, unscale, check, norm), interleaved in every iteration. And synchronize() on the
// ResNet-50 layout with float16 and bfloat16 on the wire against float32, and of the layout in
// bfloat16 averaged in bfloat16 and in float32.
#include <gradsync/gradsync.hpp>

#include <benchmark/benchmark.h>

#include "layout_model.hpp"
#include "model_layouts.hpp"
#include "results.hpp"
#include "stats.hpp"
#include "two_ranks.hpp"

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

namespace {

// Knobs.
constexpr std::size_t finalize_bytes = 64u << 20;
constexpr int repetitions = 5;
constexpr double min_seconds = 0.5;

using clock_type = std::chrono::steady_clock;

double seconds(clock_type::time_point a, clock_type::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

void finalize_pass(benchmark::State& state) {
    const std::size_t n = finalize_bytes / sizeof(float);
    std::vector<float> grads(n), copy(n);
    for (std::size_t i = 0; i < n; ++i) grads[i] = static_cast<float>((i % 1000) + 1) * 0.001f;
    std::vector<double> memcpy_s, fused_s, unfused_s;
    // Scales alternate between a factor and its inverse (powers of two), so values stay normal.
    double factor = 1.0 / 131072.0;
    int iteration = 0;
    for (auto _ : state) {
        for (int k = 0; k < 3; ++k) {
            auto t0 = clock_type::now();
            switch ((k + iteration) % 3) {
                case 0:
                    std::memcpy(copy.data(), grads.data(), finalize_bytes);
                    benchmark::ClobberMemory();
                    memcpy_s.push_back(seconds(t0, clock_type::now()));
                    break;
                case 1: {
                    gradsync::detail::SquareSum sums;
                    gradsync::detail::scale_square_sum(grads.data(), n, factor, sums);
                    benchmark::DoNotOptimize(sums.total());
                    fused_s.push_back(seconds(t0, clock_type::now()));
                    factor = 1.0 / factor;
                    break;
                }
                case 2: {
                    const float world = 0.5f, unscale = 2.0f;  // net 1: values stay where they are
                    for (auto& g : grads) g *= world;
                    for (auto& g : grads) g *= unscale;
                    bool finite = true;
                    for (float g : grads) finite = finite && std::isfinite(g);
                    double sum = 0;
                    for (float g : grads) sum += double(g) * double(g);
                    benchmark::DoNotOptimize(finite);
                    benchmark::DoNotOptimize(sum);
                    unfused_s.push_back(seconds(t0, clock_type::now()));
                    break;
                }
            }
        }
        ++iteration;
        state.SetIterationTime(fused_s.back());
    }
    const double bytes = 2.0 * finalize_bytes;  // read and written, for both
    state.counters["memcpy_GBps"] = bytes / bench::median(memcpy_s) / 1e9;
    state.counters["fused_GBps"] = bytes / bench::median(fused_s) / 1e9;
    state.counters["fused_ms"] = bench::median(fused_s) * 1e3;
    state.counters["unfused_ms"] = bench::median(unfused_s) * 1e3;
}

// synchronize() on 2 ranks of the ResNet-50 layout: float32 in place, float32 packed, and packed
// as float16 and bfloat16 on the wire, in rotating order within every iteration.
void compression(benchmark::State& state) {
    const auto tensors = layouts::resnet50();
    enum { in_place, packed, fp16, bf16, kinds };
    std::vector<double> samples[kinds];
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        struct Replicas {
            Replicas(const std::vector<layouts::Tensor>& t, gradsync::LocalBackend& b)
                : m0(t), m1(t), m2(t), m3(t), a(m0, b), p(m1, b), h(m2, b), f(m3, b) {}
            bench::LayoutModel m0, m1, m2, m3;
            gradsync::DataParallel<bench::LayoutModel, gradsync::LocalBackend> a;
            gradsync::DataParallel<bench::LayoutModel, gradsync::LocalBackend, gradsync::PackedBuckets> p;
            gradsync::DataParallel<bench::LayoutModel, gradsync::LocalBackend, gradsync::Fp16Compression> h;
            gradsync::DataParallel<bench::LayoutModel, gradsync::LocalBackend, gradsync::Bf16Compression> f;
        };
        auto r = std::make_shared<Replicas>(tensors, b);
        const bool timer = b.rank() == 0;
        return [&, r, timer, iteration = 0]() mutable {
            for (int k = 0; k < kinds; ++k) {
                const int kind = (k + iteration) % kinds;
                auto t0 = clock_type::now();
                switch (kind) {
                    case in_place: r->a.synchronize(); break;
                    case packed: r->p.synchronize(); break;
                    case fp16: r->h.synchronize(); break;
                    case bf16: r->f.synchronize(); break;
                }
                if (timer && iteration > 0) samples[kind].push_back(seconds(t0, clock_type::now()));
            }
            if (timer && iteration > 0) state.SetIterationTime(samples[bf16].back());
            ++iteration;
        };
    });
    state.counters["float_in_place_ms"] = bench::median(samples[in_place]) * 1e3;
    state.counters["float_packed_ms"] = bench::median(samples[packed]) * 1e3;
    state.counters["fp16_ms"] = bench::median(samples[fp16]) * 1e3;
    state.counters["bf16_ms"] = bench::median(samples[bf16]) * 1e3;
}

// synchronize() on 2 ranks of the ResNet-50 layout held in bfloat16: averaged in bfloat16 (in
// place) and averaged in float32 through AllreduceHook (widened into a float32 copy, rounded back),
// beside the layout in float32 averaged in place, which moves the bytes the float32 average
// moves. In rotating order within every iteration.
void float32_reduction(benchmark::State& state) {
    const auto tensors = layouts::resnet50();
    enum { bf16, bf16_in_float32, float32, kinds };
    std::vector<double> samples[kinds];
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        using Brain = bench::BasicLayoutModel<gradsync::bfloat16>;
        struct Replicas {
            Replicas(const std::vector<layouts::Tensor>& t, gradsync::LocalBackend& b)
                : m0(t), m1(t), m2(t), plain(m0, b), hooked(m1, b), wide(m2, b) {}
            Brain m0, m1;
            bench::LayoutModel m2;
            gradsync::DataParallel<Brain, gradsync::LocalBackend> plain;
            gradsync::DataParallel<Brain, gradsync::LocalBackend, gradsync::AllreduceHook> hooked;
            gradsync::DataParallel<bench::LayoutModel, gradsync::LocalBackend> wide;
        };
        auto r = std::make_shared<Replicas>(tensors, b);
        const bool timer = b.rank() == 0;
        return [&, r, timer, iteration = 0]() mutable {
            for (int k = 0; k < kinds; ++k) {
                const int kind = (k + iteration) % kinds;
                auto t0 = clock_type::now();
                switch (kind) {
                    case bf16: r->plain.synchronize(); break;
                    case bf16_in_float32: r->hooked.synchronize(); break;
                    case float32: r->wide.synchronize(); break;
                }
                if (timer && iteration > 0) samples[kind].push_back(seconds(t0, clock_type::now()));
            }
            if (timer && iteration > 0) state.SetIterationTime(samples[bf16_in_float32].back());
            ++iteration;
        };
    });
    state.counters["bf16_ms"] = bench::median(samples[bf16]) * 1e3;
    state.counters["bf16_in_float32_ms"] = bench::median(samples[bf16_in_float32]) * 1e3;
    state.counters["float32_ms"] = bench::median(samples[float32]) * 1e3;
}

}  // namespace

namespace bench {

void register_amp() {
    benchmark::RegisterBenchmark("finalize/64MiB", finalize_pass)
        ->UseManualTime()
        ->Repetitions(bench::repetitions_of(repetitions))
        ->ReportAggregatesOnly(true)
        ->MinTime(bench::min_seconds_of(min_seconds))
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("float32_reduction/resnet50", float32_reduction)
        ->UseManualTime()
        ->Repetitions(bench::repetitions_of(repetitions))
        ->ReportAggregatesOnly(true)
        ->MinTime(bench::min_seconds_of(min_seconds))
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("compression/resnet50", compression)
        ->UseManualTime()
        ->Repetitions(bench::repetitions_of(repetitions))
        ->ReportAggregatesOnly(true)
        ->MinTime(bench::min_seconds_of(min_seconds))
        ->Unit(benchmark::kMillisecond);
}

}  // namespace bench
