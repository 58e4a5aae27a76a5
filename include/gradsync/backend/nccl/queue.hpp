// How a collective is queued on one rank's NCCL communicator: behind what the compute stream was
// given so far, settled on the non-blocking communicator (polled, by the deadline), and handed to
// the watchdog; host memory staged through fixed device buffers piece by piece. Also the group of
// one call per shard that reduce_scatter and all_gather use where shards differ in length.
// Needs <nccl.h> and the CUDA runtime.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/detail/watchdog.hpp>
#include <gradsync/backend/nccl/communicator.hpp>
#include <gradsync/backend/nccl/handle.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/dtype.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>  // for std::min
#include <chrono>
#include <cstddef>
#include <cstring>  // for std::memcpy
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>  // for std::move

namespace gradsync::inline v0::detail {

// Host buffers are staged through device memory in pieces of at most this size.
inline constexpr std::size_t nccl_staging_bytes = std::size_t(1) << 20;

// Settles a call on the non-blocking communicator: ncclInProgress means NCCL is still
// queueing it (from a thread of its own, for every multi-rank collective), and nothing may
// follow until it is done. Polls without a lock; an abort request ends the poll.
inline void nccl_settle(NcclCommunicator& s, ncclResult_t r, const std::string& what) {
    if (r == ncclSuccess) return;
    s.watchdog->settle(
        [&]() -> QueueState {
            if (r == ncclInProgress) {
                ncclResult_t state = ncclSuccess;
                r = ncclCommGetAsyncError(s.comm, &state);
                if (r == ncclSuccess) r = state;
            }
            if (r == ncclInProgress) return std::nullopt;
            if (r == ncclSuccess) return std::string();
            return nccl_words(r, s.comm);
        },
        what, s.timeout);
}

// Records the completion of what was just queued and hands it to the watchdog (inside run()).
inline NcclHandle nccl_track(NcclCommunicator& s, const CollectiveCall& call) {
    cudaEvent_t event = nullptr;
    s.watchdog->with_lock([&] {  // the free list is shared with `release`, which runs under that lock
        if (!s.events.empty()) {
            event = s.events.back();
            s.events.pop_back();
        }
    });
    if (event == nullptr) {
        GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
        s.all_events.push_back(event);
    }
    GRADSYNC_CUDA_CHECK(cudaEventRecord(event, s.stream));
    auto op = std::make_shared<WatchedOp>();
    op->call = call;
    op->deadline = detail::deadline_after(s.timeout);
    op->event = event;
    s.watchdog->watch(op);
    return NcclHandle(std::move(op), s.watchdog, s.device);
}

// Host memory: each piece copied in, reduced on the device, copied out and waited for (by
// the collective's deadline, outside the watchdog's gate), through the fixed staging buffers.
template <class Issue>
NcclHandle nccl_staged(NcclCommunicator& s, const CollectiveCall& call, void* data, Issue& issue) {
    std::lock_guard staging(s.staging);
    const std::size_t unit = call.dtype ? size_of(*call.dtype) : 1;
    auto* host = static_cast<std::byte*>(data);
    const std::size_t per_piece = nccl_staging_bytes / unit;
    for (std::size_t first = 0; first < call.count; first += per_piece) {
        const std::size_t n = std::min(per_piece, call.count - first);
        const std::size_t bytes = n * unit;
        std::byte* at = host + first * unit;
        auto handle = s.watchdog->run([&] {
            std::memcpy(s.pinned, at, bytes);
            GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(s.scratch, s.pinned, bytes, cudaMemcpyHostToDevice, s.stream));
            nccl_settle(s, issue(s.scratch, n, s), call.describe());
            GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(s.pinned, s.scratch, bytes, cudaMemcpyDeviceToHost, s.stream));
            return nccl_track(s, call);
        });
        handle.wait();  // by the collective's deadline; the staging buffers are free again after it
        std::memcpy(at, s.pinned, bytes);
    }
    return NcclHandle{};
}

// Queues `call` on the memory at `data`, staging it through device memory when it lies in
// host memory; `issue(data, count, state)` issues it on a device pointer.
template <class Issue>
NcclHandle nccl_queue(NcclCommunicator& s, const CollectiveCall& call, void* data, Issue& issue) {
    if (call.count == 0) {
        s.watchdog->rethrow_if_failed();
        return NcclHandle{};
    }
    DeviceScope scope(s.device);
    if (!device_addressable(data)) return nccl_staged(s, call, data, issue);
    return s.watchdog->run([&] {
        // After what the compute stream was given so far (one event, re-recorded each time:
        // the wait takes the event as it is now).
        GRADSYNC_CUDA_CHECK(cudaEventRecord(s.computed, s.compute));
        GRADSYNC_CUDA_CHECK(cudaStreamWaitEvent(s.stream, s.computed, 0));
        nccl_settle(s, issue(data, call.count, s), call.describe());
        return nccl_track(s, call);
    });
}

// One call per non-empty shard, `issue(owner, shard)`, inside one NCCL group.
template <class Issue>
ncclResult_t nccl_grouped(int n, std::size_t count, Issue&& issue) {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (int owner = 0; owner < n; ++owner) {
        const Shard shard = shard_of(count, n, owner);
        if (shard.count == 0) continue;
        r = issue(owner, shard);
        if (r != ncclSuccess && r != ncclInProgress) break;
    }
    const ncclResult_t ended = ncclGroupEnd();
    return r != ncclSuccess && r != ncclInProgress ? r : ended;
}

}  // namespace gradsync::inline v0::detail
