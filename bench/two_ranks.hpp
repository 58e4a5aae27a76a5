// Times a collective operation on two ranks of a LocalBackend group: rank 0 runs inside the
// benchmark loop, rank 1 on a helper thread runs the same number of iterations in step with it.
#pragma once

#include <gradsync/backend/local.hpp>

#include <benchmark/benchmark.h>

#include <thread>

namespace bench {

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

}  // namespace bench
