// The options of an NcclBackend: the deadline of joining and of every collective, the streams it
// orders its collectives on and after, how often its watchdog looks, and a stop token that aborts
// it. Needs the CUDA runtime's header.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <stop_token>

namespace gradsync::inline v0 {

struct NcclOptions {
    // Joining the communicator, and every collective, must end by this long after it began;
    // otherwise the communicator is aborted and the waiters throw.
    std::chrono::milliseconds timeout{std::chrono::minutes(10)};
    // The communication stream; null: the backend creates a non-blocking stream of its own.
    cudaStream_t stream = nullptr;
    // The stream the trainer's backward runs on (null: the default stream). A collective queued
    // now reduces what this stream has been given so far, once it has done it: the
    // communication stream waits on an event recorded here, and the host does not wait at all.
    cudaStream_t compute_stream = nullptr;
    // How often the watchdog thread looks at the pending collectives; zero: no thread, only the
    // waiters look (a rank that never waits then only learns of a hang from its own sync).
    std::chrono::milliseconds watchdog_period{100};
    // A stop requested through this token aborts the communicator, even while it is joining:
    // the join and every pending and later collective throw CollectiveError. nccl_spawn uses one
    // to end every rank at once when one of them fails.
    std::stop_token stop{};
};

}  // namespace gradsync::inline v0
