// NcclHandle: a collective queued on an NcclBackend's stream, as the Waitable concept wants it,
// watched by the backend's watchdog; and NCCL's words for a failure. Needs <nccl.h> and the
// CUDA runtime.
#pragma once

#include <gradsync/backend/detail/watchdog.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/dtype.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>  // for std::move

namespace gradsync::inline v0 {

namespace detail {

inline std::optional<ncclDataType_t> nccl_type(DType t) {
    switch (t) {
        case DType::float32: return ncclFloat32;
        case DType::float64: return ncclFloat64;
        case DType::float16: return ncclFloat16;
        case DType::bfloat16: return ncclBfloat16;
        case DType::int32: return ncclInt32;
        case DType::int64: return ncclInt64;
    }
    return std::nullopt;
}

// "unhandled cuda error (...NCCL's last error...)"
inline std::string nccl_words(ncclResult_t result, ncclComm_t comm) {
    std::string out = ncclGetErrorString(result);
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') out += std::string(" (") + last + ")";
    return out;
}

}  // namespace detail

// Handle to a collective queued on an NcclBackend's stream (the Waitable concept). The buffers
// must stay valid, and untouched, until it has completed.
class NcclHandle {
public:
    NcclHandle() = default;  // an already completed no-op
    NcclHandle(std::shared_ptr<detail::WatchedOp> op, std::shared_ptr<detail::Watchdog> watchdog, int device)
        : op_(std::move(op)), watchdog_(std::move(watchdog)), device_(device) {}

    [[nodiscard]] bool ready() const { return !op_ || watchdog_->ready(*op_); }
    void wait() const { (void)wait_until(std::chrono::steady_clock::time_point::max()); }
    // False when `deadline` passed first; throws when the communicator failed first.
    [[nodiscard]] bool wait_until(std::chrono::steady_clock::time_point deadline) const {
        if (!op_) return true;
        op_->awaited.store(true, std::memory_order_release);
        return watchdog_->wait_until(*op_, deadline);
    }
    // When the watchdog or a waiter saw it complete (for timelines); only meaningful once ready().
    [[nodiscard]] std::chrono::steady_clock::time_point finished_at() const {
        return op_ ? op_->finished_at : std::chrono::steady_clock::time_point{};
    }
    // Makes `stream` wait for this collective, without blocking the host.
    void then(cudaStream_t stream) const {
        if (!op_) return;
        op_->awaited.store(true, std::memory_order_release);
        watchdog_->run([&] {
            detail::DeviceScope scope(device_);
            if (!op_->done.load(std::memory_order_acquire))
                GRADSYNC_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(op_->event), 0));
        });
    }

private:
    std::shared_ptr<detail::WatchedOp> op_;
    std::shared_ptr<detail::Watchdog> watchdog_;
    int device_ = 0;
};

}  // namespace gradsync::inline v0
