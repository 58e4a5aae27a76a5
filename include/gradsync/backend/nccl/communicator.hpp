// One rank's NCCL resources: the communicator, its streams and events, the staging buffers for
// host memory, and the watchdog that guards them, with their orderly or forced end. NcclBackend
// owns one through a pointer, so that handles and the watchdog's callbacks can reach it. Needs
// <nccl.h> and the CUDA runtime.
#pragma once

#include <gradsync/backend/detail/watchdog.hpp>
#include <gradsync/backend/nccl/handle.hpp>
#include <gradsync/backend/nccl/peer_board.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/detail/deadline.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>  // for std::fprintf
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

namespace gradsync::inline v0::detail {

struct NcclCommunicator;

// NcclOptions::stop's callback: fails the communicator (aborted at once, or by the call that
// is polling it, as it ends).
struct NcclStopRequest {
    NcclCommunicator* s;
    void operator()() const noexcept;
};

struct NcclCommunicator {
    int rank = 0, size = 1, device = 0;
    std::chrono::milliseconds timeout{};
    std::string who;
    std::atomic<std::uint64_t> calls{0};  // collectives called, to number them
    ncclComm_t comm = nullptr;
    std::atomic<bool> comm_alive{false};
    cudaStream_t stream = nullptr;
    bool own_stream = false;
    cudaStream_t compute = nullptr;
    cudaEvent_t computed = nullptr;   // recorded on `compute` before each collective
    std::vector<cudaEvent_t> events;  // free ones, under the watchdog's lock
    std::vector<cudaEvent_t> all_events;
    void* scratch = nullptr;  // device staging for host buffers, NcclBackend::staging_bytes
    void* pinned = nullptr;   // host staging the device copies to and from without blocking
    std::mutex staging;       // one staged collective at a time
    std::shared_ptr<detail::Watchdog> watchdog;
    std::optional<std::stop_callback<NcclStopRequest>> on_stop;
    std::shared_ptr<NcclPeerBoard> board;  // the ranks of this communicator in this process, once joined

    // Never while a call uses the communicator: the watchdog's gate, or the calling thread.
    void abort_comm() {
        if (!comm_alive.exchange(false)) return;
        DeviceScope scope(device);
        ncclCommAbort(comm);
    }

    void close() {
        on_stop.reset();  // waits for a stop request in progress
        if (board) board->leave(rank);
        // Collectives nobody waits for (an exception unwound past their wait) were abandoned:
        // flushing them would wait for peers that may never issue theirs, for the whole timeout,
        // so the communicator is aborted instead and the peers learn of it by their deadlines.
        // Those a stream or the host waits for are flushed, by their own deadlines.
        PendingOps pending;
        if (watchdog && !watchdog->failed()) {
            watchdog->check();
            pending = watchdog->pending();
        }
        if (pending.abandoned != 0)
            std::fprintf(stderr,
                         "%s: destroyed while %zu collective%s nobody waits for had not completed (the first: %s): "
                         "the communicator is aborted, not flushed\n",
                         who.c_str(), pending.abandoned, pending.abandoned == 1 ? "" : "s",
                         pending.first_abandoned.c_str());
        const bool failed = (watchdog && watchdog->failed()) || pending.abandoned != 0;
        // Handles that outlive the backend must not reach the communicator or this state.
        if (watchdog) watchdog->close(who + ": the backend was destroyed");
        DeviceScope scope(device);
        if (comm_alive && !failed) {
            // Flush what is queued, by the deadline, then free; a communicator that cannot
            // be flushed in time is aborted below.
            ncclResult_t state = ncclCommFinalize(comm);
            const auto deadline = pending.count != 0 ? pending.latest_deadline : detail::deadline_after(timeout);
            while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
                std::this_thread::sleep_for(std::chrono::microseconds(200));
                if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
            }
            if (state == ncclSuccess && ncclCommDestroy(comm) == ncclSuccess) comm_alive = false;
        }
        abort_comm();
        for (auto e : all_events) cudaEventDestroy(e);
        if (computed != nullptr) cudaEventDestroy(computed);
        if (scratch != nullptr) cudaFree(scratch);
        if (pinned != nullptr) cudaFreeHost(pinned);
        if (own_stream) cudaStreamDestroy(stream);
    }
};

inline void NcclStopRequest::operator()() const noexcept {
    try {
        s->watchdog->fail(s->who + ": stopped through NcclOptions::stop (in nccl_spawn: another rank failed)");
    } catch (...) {
    }
}

// The watchdog's view of this rank's GPU and communicator. Each callback selects the rank's
// device: it may run on any thread (the watchdog's own, or a waiter's).
inline WatchedDevice watched_device(NcclCommunicator* s) {
    return WatchedDevice{.finished =
                             [s](void* event) {
                                 DeviceScope scope(s->device);
                                 const cudaError_t code = cudaEventQuery(static_cast<cudaEvent_t>(event));
                                 if (code == cudaErrorNotReady) return false;
                                 GRADSYNC_CUDA_CHECK(code);
                                 return true;
                             },
                         .error = [s]() -> std::string {
                             if (!s->comm_alive) return {};
                             ncclResult_t async = ncclSuccess;
                             const ncclResult_t got = ncclCommGetAsyncError(s->comm, &async);
                             if (got != ncclSuccess) return nccl_words(got, s->comm);
                             if (async == ncclSuccess || async == ncclInProgress) return {};
                             return nccl_words(async, s->comm);
                         },
                         .abort = [s] { s->abort_comm(); },
                         .release = [s](void* event) { s->events.push_back(static_cast<cudaEvent_t>(event)); },
                         .enter_thread = [s] { GRADSYNC_CUDA_CHECK(cudaSetDevice(s->device)); },
                         .peers = [s] { return s->board ? s->board->standings(s->rank) : std::string(); }};
}

}  // namespace gradsync::inline v0::detail
