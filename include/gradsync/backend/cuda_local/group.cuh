// The shared state of a CudaLocalBackend group (the rendezvous where ranks publish and compare
// their calls, the options, the stream where rank 0 queues the group's device work) and the
// handle of one collective. Needs nvcc.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/detail/rendezvous.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/detail/deadline.hpp>

#include <cuda_runtime.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>  // for std::move

namespace gradsync::inline v0 {

struct CudaLocalOptions {
    int device = 0;  // the GPU every rank uses
    // Every rendezvous and every collective ends by then; otherwise the group is aborted.
    std::chrono::milliseconds timeout = std::chrono::seconds(600);
};

namespace cuda::detail {

// A CUDA event shared by the handles of one collective, destroyed with the last of them.
using SharedEvent = std::shared_ptr<CUevent_st>;

inline SharedEvent make_event() {
    cudaEvent_t e = nullptr;
    GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return SharedEvent(e, [](cudaEvent_t x) { cudaEventDestroy(x); });
}

// What each rank publishes at a rendezvous: the collective, its memory, and its events.
struct LocalDeviceCall : CollectiveCall {
    void* data = nullptr;
    bool on_device = false;
    cudaEvent_t ready = nullptr;  // recorded on the rank's compute stream when it called
    SharedEvent done;             // the second round: rank 0's, when the device work is queued

    [[nodiscard]] bool same_call(const LocalDeviceCall& o) const { return same_as(o) && on_device == o.on_device; }
    [[nodiscard]] std::string what() const { return describe() + (on_device ? "" : ", host memory"); }
};

struct LocalDeviceGroup {
    LocalDeviceGroup(int size, CudaLocalOptions o) : meet(size, o.timeout), options(o) {
        GRADSYNC_CUDA_CHECK(cudaSetDevice(o.device));
        GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    }
    LocalDeviceGroup(const LocalDeviceGroup&) = delete;
    LocalDeviceGroup& operator=(const LocalDeviceGroup&) = delete;
    ~LocalDeviceGroup() { cudaStreamDestroy(stream); }

    gradsync::detail::Rendezvous<LocalDeviceCall> meet;
    CudaLocalOptions options;
    cudaStream_t stream = nullptr;  // where rank 0 queues the group's device work
};

}  // namespace cuda::detail

// Handle to a CudaLocalBackend collective (the Waitable concept).
class CudaLocalHandle {
public:
    CudaLocalHandle() = default;  // an already completed no-op
    CudaLocalHandle(cuda::detail::SharedEvent done, std::shared_ptr<cuda::detail::LocalDeviceGroup> group,
                    std::string what)
        : done_(std::move(done)),
          group_(std::move(group)),
          what_(std::move(what)),
          deadline_(detail::deadline_after(group_->options.timeout)) {}

    [[nodiscard]] bool ready() const {
        if (!done_ || group_->meet.failed()) return true;
        const cudaError_t code = cudaEventQuery(done_.get());
        if (code == cudaErrorNotReady) return false;
        if (code != cudaSuccess) cudaGetLastError();
        return true;
    }
    void wait() const { (void)wait_until(std::chrono::steady_clock::time_point::max()); }
    [[nodiscard]] bool wait_until(std::chrono::steady_clock::time_point deadline) const {
        if (!done_) return true;
        for (;;) {
            group_->meet.throw_if_failed();
            const cudaError_t code = cudaEventQuery(done_.get());
            if (code == cudaSuccess) return true;
            if (code != cudaErrorNotReady) GRADSYNC_CUDA_CHECK(code);
            const auto now = std::chrono::steady_clock::now();
            if (now >= deadline_) {
                group_->meet.abort("gradsync: " + what_ + " did not complete on the device within " +
                                   std::to_string(group_->options.timeout.count()) + " ms; the group was aborted");
                group_->meet.throw_if_failed();
            }
            if (now >= deadline) return false;
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }
    // Makes `stream` wait for this collective, without blocking the host.
    void then(cudaStream_t stream) const {
        if (done_) GRADSYNC_CUDA_CHECK(cudaStreamWaitEvent(stream, done_.get(), 0));
    }
    [[nodiscard]] std::chrono::steady_clock::time_point finished_at() const { return {}; }

private:
    cuda::detail::SharedEvent done_;
    std::shared_ptr<cuda::detail::LocalDeviceGroup> group_;
    std::string what_;
    std::chrono::steady_clock::time_point deadline_{};
};

}  // namespace gradsync::inline v0
