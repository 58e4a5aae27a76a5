// A trainer's collective calls written once, against any backend: what every backend offers
// alike (typed spans of any float type, sum as the default op, async twins, typed broadcast).
// Instantiated for LocalBackend and MpiBackend (and run), and for NcclBackend and
// CudaLocalBackend by nvcc, where the spans must be device memory.
#pragma once

#include <gradsync/buffer.hpp>
#include <gradsync/half.hpp>

#include <cstdint>
#include <span>

namespace generic {

// Sums `grads` (float), then averages them, averages `stats` (double) and `halves` (float16),
// and copies rank 0's `seeds` to every rank.
template <class Backend>
void collective_step(Backend& backend, std::span<float> grads, std::span<double> stats,
                     std::span<gradsync::float16> halves, std::span<std::int64_t> seeds) {
    backend.allreduce(grads);  // the default op: sum
    backend.allreduce_async(grads, gradsync::ReduceOp::average).wait();
    backend.allreduce(stats, gradsync::ReduceOp::average);
    backend.allreduce(gradsync::buffer_of(halves), gradsync::ReduceOp::average);
    backend.broadcast(seeds, 0);
    backend.barrier();
}

}  // namespace generic
