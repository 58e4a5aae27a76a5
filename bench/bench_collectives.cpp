// LocalBackend collectives on 2 ranks: allreduce bandwidth from 4 KiB to 256 MiB beside the
// single-thread memcpy bandwidth at the same size (the ceiling), and small-message latency; then
// both again beside one busy-looping thread per core, as a trainer's own compute threads would be.
// Last, reduce_scatter then all_gather (sharded data parallel's two halves) against the allreduce
// of the same buffer, interleaved; for the sizes that fit in cache, the allreduce against its
// ceilings taken in turn (in_cache); and what two threads take to meet twice (the floor of any
// collective's latency).
#include <gradsync/backend/local.hpp>

#include <benchmark/benchmark.h>

#include "busy_neighbours.hpp"
#include "results.hpp"
#include "stats.hpp"
#include "two_ranks.hpp"

#include <algorithm>  // for std::min_element, std::max_element
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <thread>
#include <vector>

namespace {

// Knobs.
constexpr std::int64_t smallest_bytes = 4 << 10;
constexpr std::int64_t largest_bytes = 256 << 20;
constexpr std::int64_t latency_bytes[] = {4, 16, 64, 256, 1024, 4096};
constexpr std::int64_t busy_latency_bytes[] = {4, 256};
constexpr std::int64_t busy_bandwidth_bytes = 64 << 20;
constexpr int repetitions = 5;
constexpr double min_seconds = 0.2;
constexpr std::int64_t sharded_bytes[] = {1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20};
constexpr std::int64_t in_cache_largest = 4 << 20;  // in cache: above it memory bounds both
constexpr double in_cache_seconds = 1.0;            // the medians of in_cache_2_ranks take this long
constexpr int sharded_iterations = 15;

// Both buffers 64-byte aligned: glibc copies 2 KiB and up with `rep movsb`, which on some x86
// processors (this development VM's AMD EPYC among them) runs at about 1.7 GB/s when source and
// destination differ in their offset within a cache line, as two std::vector<char> may.
struct AlignedBuffer {
    explicit AlignedBuffer(std::size_t bytes, char fill = 1) : storage(bytes + 64, fill) {
        const auto address = reinterpret_cast<std::uintptr_t>(storage.data());
        data = storage.data() + (64 - address % 64) % 64;
    }
    AlignedBuffer(const AlignedBuffer&) = delete;  // `data` points into `storage`
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;
    std::vector<char> storage;  // touched before timing
    char* data;
};

void memcpy_bandwidth(benchmark::State& state) {
    const auto bytes = static_cast<std::size_t>(state.range(0));
    AlignedBuffer src(bytes, 1), dst(bytes, 2);
    for (auto _ : state) {
        std::memcpy(dst.data, src.data, bytes);
        benchmark::DoNotOptimize(dst.data);
        benchmark::ClobberMemory();
    }
    state.SetBytesProcessed(state.iterations() * state.range(0));
}

void allreduce(benchmark::State& state) {
    const auto count = static_cast<std::size_t>(state.range(0)) / sizeof(float);
    bench::time_on_two_ranks(state, [count](gradsync::LocalBackend& b) {
        return [&b, data = std::vector<float>(count, 1.0f)]() mutable {
            b.allreduce(std::span<float>(data), gradsync::ReduceOp::sum);
        };
    });
    state.SetBytesProcessed(state.iterations() * state.range(0));  // algbw
}

// In cache, four figures of the same size taken in turn in every iteration, so that all four meet
// the two cores placed alike (on the development VMs what crossing between them costs changes by
// 2 to 5 times from one minute to the next, so figures of benchmarks run minutes apart do not
// compare): one thread's memcpy (the ceiling); the allreduce repeated on the same buffers (each
// rank finds in its own cache what it wrote there last call); a memcpy from a buffer the other
// core has just written (the ceiling of what crosses between the cores); and the allreduce after
// each rank wrote its buffer, as backward writes the gradients (half of what a rank reads then
// crosses). Ratios are medians of the per-iteration ratios. Calls are timed in batches where they
// are short, so that the clock's cost stays small.
void in_cache(benchmark::State& state) {
    const auto bytes = static_cast<std::size_t>(state.range(0));
    const int batch = static_cast<int>(std::max<std::size_t>(1, (std::size_t{256} << 10) / bytes));
    AlignedBuffer written(bytes);  // written by rank 1, copied by rank 0
    std::vector<double> copy_s, allreduce_s, across_s, after_s, ratios, after_ratios;
    using clock = std::chrono::steady_clock;
    auto since = [](clock::time_point start) { return std::chrono::duration<double>(clock::now() - start).count(); };
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        const bool timer = b.rank() == 0;
        return [&, timer, data = std::vector<float>(bytes / sizeof(float), 1.0f),
                local = std::make_shared<AlignedBuffer>(timer ? bytes : 0),
                copy = std::make_shared<AlignedBuffer>(timer ? bytes : 0), warm = false]() mutable {
            const auto iteration_start = clock::now();
            double memcpy_s = 0, allreduce = 0, across = 0, after = 0;
            if (timer) {
                std::memcpy(copy->data, local->data, bytes);  // into cache: the other phases evicted it
                const auto start = clock::now();
                for (int i = 0; i < batch; ++i) {
                    std::memcpy(copy->data, local->data, bytes);
                    benchmark::ClobberMemory();
                }
                memcpy_s = since(start) / batch;
            }
            b.barrier();
            b.allreduce(std::span<float>(data), gradsync::ReduceOp::sum);  // each share into its rank's cache
            auto start = clock::now();
            for (int i = 0; i < batch; ++i) b.allreduce(std::span<float>(data), gradsync::ReduceOp::sum);
            allreduce = since(start) / batch;
            for (int i = 0; i < batch; ++i) {
                if (!timer) std::memset(written.data, i, bytes);
                b.barrier();
                if (timer) {
                    start = clock::now();
                    std::memcpy(copy->data, written.data, bytes);
                    benchmark::ClobberMemory();
                    across += since(start) / batch;
                }
                b.barrier();
            }
            for (int i = 0; i < batch; ++i) {
                std::memset(data.data(), 0, bytes);
                start = clock::now();
                b.allreduce(std::span<float>(data), gradsync::ReduceOp::sum);
                after += since(start) / batch;
            }
            if (timer && warm) {
                copy_s.push_back(memcpy_s);
                allreduce_s.push_back(allreduce);
                across_s.push_back(across);
                after_s.push_back(after);
                ratios.push_back(memcpy_s / allreduce);  // busbw / memcpy: busbw = algbw on 2 ranks
                after_ratios.push_back(across / after);
                state.SetIterationTime(since(iteration_start));  // so that MinTime bounds the run
            }
            warm = true;
        };
    });
    state.counters["memcpy_us"] = bench::median(copy_s) * 1e6;
    state.counters["allreduce_us"] = bench::median(allreduce_s) * 1e6;
    state.counters["cross_core_us"] = bench::median(across_s) * 1e6;
    state.counters["after_write_us"] = bench::median(after_s) * 1e6;
    state.counters["busbw_over_memcpy"] = bench::median(ratios);
    state.counters["after_write_over_cross_core"] = bench::median(after_ratios);
}

void allreduce_busy(benchmark::State& state) {
    bench::BusyNeighbours busy;
    allreduce(state);
}

void memcpy_busy(benchmark::State& state) {
    bench::BusyNeighbours busy;
    memcpy_bandwidth(state);
}

// reduce_scatter + all_gather against one allreduce of the same bytes, alternating which goes
// first; the ratio is the median of the per-iteration ratios.
void sharded_vs_allreduce(benchmark::State& state) {
    const auto count = static_cast<std::size_t>(state.range(0)) / sizeof(float);
    std::vector<double> sharded_s, allreduce_s, ratios;
    bench::time_on_two_ranks(state, [&](gradsync::LocalBackend& b) {
        const bool timer = b.rank() == 0;
        return [&, timer, data = std::vector<float>(count, 1.0f), sharded_first = false, warm = false]() mutable {
            auto [s, a] = bench::timed_pair(
                [&] {
                    b.reduce_scatter(std::span<float>(data), gradsync::ReduceOp::average);
                    b.all_gather(std::span<float>(data));
                },
                [&] { b.allreduce(std::span<float>(data), gradsync::ReduceOp::average); }, !sharded_first);
            if (timer && warm) {
                sharded_s.push_back(s);
                allreduce_s.push_back(a);
                ratios.push_back(s / a);
                state.SetIterationTime(s);
            }
            sharded_first = !sharded_first;
            warm = true;
        };
    });
    state.counters["sharded_us"] = bench::median(sharded_s) * 1e6;
    state.counters["allreduce_us"] = bench::median(allreduce_s) * 1e6;
    state.counters["sharded_over_allreduce"] = bench::median(ratios);
}

// The floor under any 2-rank collective: two threads meet twice (as an allreduce's ranks do, once
// when both have arrived and once when both are done), spinning on one shared cache line, so
// that it crosses between the cores four times.
void two_meetings(benchmark::State& state) {
    struct alignas(64) Arrivals {
        std::atomic<std::uint64_t> count{0};
    };
    Arrivals arrivals;
    // Meeting n (1, 2, ...) ends once both threads arrived at it.
    auto meet = [&arrivals](std::uint64_t n) {
        arrivals.count.fetch_add(1, std::memory_order_acq_rel);
        while (arrivals.count.load(std::memory_order_acquire) < 2 * n) {
        }
    };
    const auto iterations = static_cast<std::uint64_t>(state.max_iterations);
    std::thread other([&] {
        for (std::uint64_t i = 0; i < 2 * iterations + 2; ++i) meet(i + 1);
    });
    meet(1), meet(2);  // warm
    std::uint64_t n = 3;
    for (auto _ : state) {
        meet(n), meet(n + 1);
        n += 2;
    }
    other.join();
}

// Repetitions reported by their median, and by their fastest and slowest: the spread.
void repeated(benchmark::internal::Benchmark* b) {
    b->UseRealTime()
        ->Repetitions(bench::repetitions_of(repetitions))
        ->ReportAggregatesOnly(true)
        ->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); })
        ->ComputeStatistics("max", [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); })
        ->MinTime(bench::min_seconds_of(min_seconds))
        ->Unit(benchmark::kMicrosecond);
}

void for_busy_latency(benchmark::internal::Benchmark* b) {
    b->ArgName("bytes");
    for (auto s : busy_latency_bytes) b->Arg(s);
    repeated(b);
}

void for_busy_bandwidth(benchmark::internal::Benchmark* b) {
    b->ArgName("bytes")->Arg(busy_bandwidth_bytes);
    repeated(b);
}

void for_sizes(benchmark::internal::Benchmark* b) {
    b->ArgName("bytes");
    for (std::int64_t s = smallest_bytes; s <= largest_bytes; s *= 4) b->Arg(s);
    b->UseRealTime()
        ->Repetitions(bench::repetitions_of(repetitions))
        ->ReportAggregatesOnly(true)
        ->MinTime(bench::min_seconds_of(min_seconds));
    b->Unit(benchmark::kMicrosecond);
}

void for_in_cache(benchmark::internal::Benchmark* b) {
    b->ArgName("bytes");
    for (std::int64_t s = smallest_bytes; s <= in_cache_largest; s *= 4) b->Arg(s);
    b->UseManualTime()->MinTime(bench::min_seconds_of(in_cache_seconds))->Unit(benchmark::kMicrosecond);
}

void for_latency(benchmark::internal::Benchmark* b) {
    b->ArgName("bytes");
    for (auto s : latency_bytes) b->Arg(s);
    b->UseRealTime()
        ->Repetitions(bench::repetitions_of(repetitions))
        ->ReportAggregatesOnly(true)
        ->MinTime(bench::min_seconds_of(min_seconds));
    b->Unit(benchmark::kMicrosecond);
}

}  // namespace

namespace bench {

void register_collectives() {
    benchmark::RegisterBenchmark("memcpy", memcpy_bandwidth)->Apply(for_sizes);
    benchmark::RegisterBenchmark("allreduce_2_ranks", allreduce)->Apply(for_sizes);
    benchmark::RegisterBenchmark("allreduce_latency_2_ranks", allreduce)->Apply(for_latency);
    benchmark::RegisterBenchmark("busy/allreduce_latency_2_ranks", allreduce_busy)->Apply(for_busy_latency);
    benchmark::RegisterBenchmark("busy/allreduce_2_ranks", allreduce_busy)->Apply(for_busy_bandwidth);
    benchmark::RegisterBenchmark("busy/memcpy", memcpy_busy)->Apply(for_busy_bandwidth);
    benchmark::RegisterBenchmark("two_meetings", two_meetings)->Apply(repeated);
    benchmark::RegisterBenchmark("in_cache_2_ranks", in_cache)->Apply(for_in_cache);
    for (auto bytes : sharded_bytes) {
        if (bench::quick() && bytes != sharded_bytes[0]) continue;
        benchmark::RegisterBenchmark("sharded_vs_allreduce_2_ranks", sharded_vs_allreduce)
            ->ArgName("bytes")
            ->Arg(bytes)
            ->UseManualTime()
            ->Iterations(bench::iterations_of(sharded_iterations + 1))
            ->Unit(benchmark::kMicrosecond);
    }
}

}  // namespace bench
