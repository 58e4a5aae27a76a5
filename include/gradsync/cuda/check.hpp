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

// Makes `device` current while it lives and restores the caller's.
class DeviceScope {
public:
    explicit DeviceScope(int device) {
        GRADSYNC_CUDA_CHECK(cudaGetDevice(&before_));
        if (before_ != device) GRADSYNC_CUDA_CHECK(cudaSetDevice(device));
        changed_ = before_ != device;
    }
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;
    ~DeviceScope() {
        if (changed_) cudaSetDevice(before_);
    }

private:
    int before_ = 0;
    bool changed_ = false;
};

}  // namespace detail

}  // namespace gradsync::inline v0
