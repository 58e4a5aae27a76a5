// Checked CUDA calls: a failure becomes a CudaError that names the call, where it was made, and
// CUDA's own words, instead of a status code nobody reads. Needs <cuda_runtime.h> and the CUDA
// runtime library; compiles with nvcc or a host compiler.
#pragma once

#include <gradsync/error.hpp>

#include <cuda_runtime.h>

#include <string>
#include <utility>  // for std::move

namespace gradsync::inline v0 {

class CudaError : public Error {
public:
    CudaError(std::string what, cudaError_t code) : Error(std::move(what)), code_(code) {}
    [[nodiscard]] cudaError_t code() const noexcept { return code_; }

private:
    cudaError_t code_;
};

namespace detail {

inline void check_cuda(cudaError_t code, const char* call, const char* file, int line) {
    if (code == cudaSuccess) return;
    // The runtime keeps the failure as this thread's last error too: cleared, so that the next
    // check after a launch (cudaGetLastError) does not report it again as the launch's.
    cudaGetLastError();
    throw CudaError("gradsync: " + std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                        cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ")",
                    code);
}

// Checks a CUDA runtime call: GRADSYNC_CUDA_CHECK(cudaMalloc(&p, bytes));
#define GRADSYNC_CUDA_CHECK(call) ::gradsync::detail::check_cuda((call), #call, __FILE__, __LINE__)

// True for memory the GPU can address (device or managed); false for host memory, which a
// device collective cannot take as it is.
inline bool device_addressable(const void* p) {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

}  // namespace detail

// The CUDA devices this process sees. Without a device or a driver, count is 0 and `why` says
// which, so that GPU code can be skipped with a reason rather than fail.
struct CudaDevices {
    int count = 0;
    std::string why;
};

inline CudaDevices cuda_devices() {
    int count = 0;
    const cudaError_t code = cudaGetDeviceCount(&count);
    if (code == cudaSuccess && count > 0) return {count, ""};
    cudaGetLastError();  // clear the error, so the next checked call does not report it
    if (code == cudaSuccess) return {0, "no CUDA device"};
    return {0, std::string("no CUDA device: ") + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ")"};
}

namespace detail {

// Whether the calling thread has a current CUDA context. One that never chose a device has none:
// making device 0 current there (as restoring cudaGetDevice's answer would) creates a context on
// a GPU this process may never use. True where the driver cannot be asked (CUDA before 12.5).
inline bool thread_has_context() {
#if CUDART_VERSION >= 12050
    using GetCurrent = int (*)(void** context);  // the driver's cuCtxGetCurrent
    static const GetCurrent get = [] {
        void* function = nullptr;
        cudaDriverEntryPointQueryResult found{};
        if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &function, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            return GetCurrent{nullptr};
        }
        return reinterpret_cast<GetCurrent>(function);
    }();
    void* context = nullptr;
    return get == nullptr || (get(&context) == 0 && context != nullptr);
#else
    return true;
#endif
}

// The device `stream` belongs to (the current one for the default stream).
inline int device_of(cudaStream_t stream) {
    int device = 0;
#if CUDART_VERSION >= 12080
    if (stream != nullptr) {
        GRADSYNC_CUDA_CHECK(cudaStreamGetDevice(stream, &device));
        return device;
    }
#endif
    GRADSYNC_CUDA_CHECK(cudaGetDevice(&device));
    return device;
}

// Makes `device` current while it lives and restores the caller's; a thread that had no current
// context keeps `device` (see thread_has_context).
class DeviceScope {
public:
    explicit DeviceScope(int device) {
        GRADSYNC_CUDA_CHECK(cudaGetDevice(&before_));
        if (before_ == device) return;
        restore_ = thread_has_context();
        GRADSYNC_CUDA_CHECK(cudaSetDevice(device));
    }
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;
    ~DeviceScope() {
        if (restore_) cudaSetDevice(before_);
    }

private:
    int before_ = 0;
    bool restore_ = false;
};

}  // namespace detail

}  // namespace gradsync::inline v0
