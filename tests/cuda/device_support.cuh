// What the CUDA tests share: device arrays, streams, NCCL ids, bitwise comparison and a model whose
// parameters each have their own device allocation. Compiled by nvcc, run on a GPU or on the
// stand-in CUDA runtime (tests/standin).
#pragma once

#include <gradsync/backend/cuda_local.cuh>
#include <gradsync/backend/nccl.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/launch/nccl_spawn.hpp>
#include <gradsync/model/model.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Spins for about `cycles` clock cycles (test_hooks_on_device.cu): work still running on its
// stream when the host looks.
namespace test_kernels {
__global__ void spin(long long cycles);
}  // namespace test_kernels

namespace device_test {

// Device memory for a test, freed at the end of scope.
template <class T>
struct DeviceArray {
    T* data = nullptr;
    std::size_t size = 0;
    explicit DeviceArray(std::size_t n) : size(n) {
        if (n != 0) GRADSYNC_CUDA_CHECK(cudaMalloc(&data, n * sizeof(T)));
    }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    ~DeviceArray() { cudaFree(data); }
    void upload(const std::vector<T>& host) {
        if (size != 0) GRADSYNC_CUDA_CHECK(cudaMemcpy(data, host.data(), size * sizeof(T), cudaMemcpyHostToDevice));
    }
    std::vector<T> download() const {
        std::vector<T> host(size);
        if (size != 0) GRADSYNC_CUDA_CHECK(cudaMemcpy(host.data(), data, size * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
};

// A fresh NCCL unique id: each test's communicators of their own.
inline ncclUniqueId nccl_id() {
    ncclUniqueId id{};
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
        throw std::runtime_error(std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(r));
    return id;
}

// A non-blocking stream, destroyed at the end of its scope once its work is done.
struct Stream {
    cudaStream_t s = nullptr;
    Stream() { GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    ~Stream() {
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
    }
    operator cudaStream_t() const { return s; }
};

// Bitwise equality (NaN payloads, -0.0 and 16-bit values included).
template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Parameters (three unless told), each with its own device allocation: their gradients are no view, so
// DataParallel packs them (world > 1) or finalizes them through the device table.
struct ScatteredDeviceModel {
    std::vector<std::size_t> sizes;
    std::vector<float*> weights, grads;
    ScatteredDeviceModel() : ScatteredDeviceModel({1000, 3, 70000}) {}
    explicit ScatteredDeviceModel(std::vector<std::size_t> parameter_sizes) : sizes(std::move(parameter_sizes)) {
        for (auto n : sizes) {
            weights.push_back(nullptr);
            grads.push_back(nullptr);
            GRADSYNC_CUDA_CHECK(cudaMalloc(&weights.back(), n * sizeof(float)));
            GRADSYNC_CUDA_CHECK(cudaMalloc(&grads.back(), (n + 64) * sizeof(float)));  // a gap after each
            GRADSYNC_CUDA_CHECK(cudaMemset(weights.back(), 0, n * sizeof(float)));
        }
    }
    ScatteredDeviceModel(const ScatteredDeviceModel&) = delete;
    ScatteredDeviceModel& operator=(const ScatteredDeviceModel&) = delete;
    ~ScatteredDeviceModel() {
        for (auto* p : weights) cudaFree(p);
        for (auto* p : grads) cudaFree(p);
    }
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        for (std::size_t i = 0; i < sizes.size(); ++i)
            out.push_back({"p" + std::to_string(i), weights[i], grads[i], sizes[i], gradsync::DType::float32});
        return out;
    }
    // Gradient i, element k: (k % 17 - 8) * scale.
    std::vector<std::vector<float>> fill(float scale) {
        std::vector<std::vector<float>> host;
        for (std::size_t i = 0; i < sizes.size(); ++i) {
            host.emplace_back(sizes[i]);
            for (std::size_t k = 0; k < sizes[i]; ++k) host[i][k] = (float(k % 17) - 8.0f) * scale;
            GRADSYNC_CUDA_CHECK(cudaMemcpy(grads[i], host[i].data(), sizes[i] * sizeof(float), cudaMemcpyHostToDevice));
        }
        // A copy from pageable memory may land after cudaMemcpy returns, on the default stream,
        // which the trainer's non-blocking stream does not wait for.
        GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
        return host;
    }
    std::vector<float> grad(std::size_t i) const {
        std::vector<float> out(sizes[i]);
        GRADSYNC_CUDA_CHECK(cudaMemcpy(out.data(), grads[i], sizes[i] * sizeof(float), cudaMemcpyDeviceToHost));
        return out;
    }
};

// body(backend, stream) on n ranks of CudaLocalBackend or NcclBackend (one per GPU), each with a
// compute stream of its own.
template <class Body>
void on_cuda_local_with_stream(int n, Body&& body) {
    gradsync::cuda_local_spawn(n, [&](gradsync::CudaLocalBackend& backend) {
        const Stream stream;
        backend.set_compute_stream(stream);
        body(backend, stream);
    });
}
template <class Body>
void on_nccl_with_stream(int n, Body&& body) {
    gradsync::nccl_spawn(n, [&](gradsync::NcclBackend<>& backend) {
        const Stream stream;
        backend.set_compute_stream(stream);
        body(backend, stream);
    });
}

// Whether `call` returns while work queued on `stream` before it (a kernel that spins about a
// second) still runs: it then made the host wait for none of the stream's work.
template <class Call>
bool returns_while_queued_work_runs(cudaStream_t stream, Call&& call) {
    cudaEvent_t spun = nullptr;
    GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&spun, cudaEventDisableTiming));
    test_kernels::spin<<<1, 1, 0, stream>>>(2'000'000'000LL);
    GRADSYNC_CUDA_CHECK(cudaGetLastError());
    GRADSYNC_CUDA_CHECK(cudaEventRecord(spun, stream));
    call();
    const bool running = cudaEventQuery(spun) == cudaErrorNotReady;
    GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
    GRADSYNC_CUDA_CHECK(cudaEventDestroy(spun));
    return running;
}

}  // namespace device_test
