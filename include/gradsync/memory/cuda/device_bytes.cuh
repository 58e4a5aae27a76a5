// DeviceBytes: device memory owned by one object, freed with it; made with a stream, allocated
// and freed in that stream's order. Needs the CUDA runtime.
#pragma once

#include <gradsync/cuda/check.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>  // for std::exchange

namespace gradsync::inline v0::cuda {

// Device memory owned by one object; size() in bytes. Made with a stream, it is allocated and
// freed in that stream's order (cudaMallocAsync, cudaFreeAsync): freeing it then waits for
// neither the host nor the rest of the device, unlike cudaFree.
class DeviceBytes {
public:
    DeviceBytes() = default;
    explicit DeviceBytes(std::size_t bytes) : size_(bytes) {
        if (bytes != 0) GRADSYNC_CUDA_CHECK(cudaMalloc(&data_, bytes));
    }
    DeviceBytes(std::size_t bytes, cudaStream_t stream) : size_(bytes), stream_(stream), ordered_(true) {
        if (bytes != 0) GRADSYNC_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
    }
    DeviceBytes(DeviceBytes&& o) noexcept
        : data_(std::exchange(o.data_, nullptr)),
          size_(std::exchange(o.size_, 0)),
          stream_(o.stream_),
          ordered_(o.ordered_) {}
    DeviceBytes& operator=(DeviceBytes&& o) noexcept {
        if (this != &o) {
            release();
            data_ = std::exchange(o.data_, nullptr);
            size_ = std::exchange(o.size_, 0);
            stream_ = o.stream_;
            ordered_ = o.ordered_;
        }
        return *this;
    }
    DeviceBytes(const DeviceBytes&) = delete;
    DeviceBytes& operator=(const DeviceBytes&) = delete;
    ~DeviceBytes() { release(); }

    [[nodiscard]] std::byte* data() const { return static_cast<std::byte*>(data_); }
    [[nodiscard]] std::size_t size() const { return size_; }

private:
    void release() {
        if (data_ == nullptr) return;
        if (ordered_)
            cudaFreeAsync(data_, stream_);
        else
            cudaFree(data_);
    }

    void* data_ = nullptr;
    std::size_t size_ = 0;
    cudaStream_t stream_ = nullptr;
    bool ordered_ = false;
};

}  // namespace gradsync::inline v0::cuda
