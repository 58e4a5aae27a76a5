// Times a collective operation on two ranks of a LocalBackend group: rank 0 runs inside the
// benchmark loop, rank 1 on a helper thread runs the same number of iterations in step with it.
#pragma once

#include <gradsync/backend/local.hpp>

#include <benchmark/benchmark.h>

#include "results.hpp"

#include <chrono>
#include <thread>
#include <utility>  // for std::pair

namespace bench {

// Benchmarks timed by hand (SetIterationTime), repeated and reported by their median, in ms.
inline void timed_by_hand(benchmark::internal::Benchmark* b, int repetitions, double min_seconds) {
    b->UseManualTime()
        ->Repetitions(repetitions_of(repetitions))
        ->ReportAggregatesOnly(true)
        ->MinTime(min_seconds_of(min_seconds));
    b->Unit(benchmark::kMillisecond);
}

// `make(backend)` runs on each rank's thread and returns that rank's operation (a callable).
// Both are called once to warm up before timing starts.
template <class Make>
void time_on_two_ranks(benchmark::State& state, Make make, gradsync::LocalGroupOptions options = {}) {
    auto ranks = gradsync::LocalBackend::create_group(2, options);
    const auto iterations = state.max_iterations;
    std::thread helper([&] {
        auto op = make(ranks[1]);
        op();
        for (benchmark::IterationCount i = 0; i < iterations; ++i) op();
    });
    auto op = make(ranks[0]);
    op();
    for (auto _ : state) op();
    helper.join();
}

// Times a() and b() back to back, b first when `b_first` (alternate it, so that neither always
// runs on a cache the other warmed). Returns {a's seconds, b's seconds}.
template <class A, class B>
std::pair<double, double> timed_pair(A&& a, B&& b, bool b_first) {
    using clock = std::chrono::steady_clock;
    auto t0 = clock::now();
    b_first ? b() : a();
    auto t1 = clock::now();
    b_first ? a() : b();
    auto t2 = clock::now();
    double first = std::chrono::duration<double>(t1 - t0).count();
    double second = std::chrono::duration<double>(t2 - t1).count();
    return b_first ? std::pair(second, first) : std::pair(first, second);
}

}  // namespace bench
