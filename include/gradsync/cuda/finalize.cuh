// The fused finalize pass on the device: data[i] = T(data[i] * factor) in place (1 / (world size x
// loss scale)), and the sum of the squares of the values written, for the global norm, in one
// read and one write of each element and one launch. Non-finite values need no flag of their
// own: squares are summed in double, where no finite gradient overflows, so the sum is
// non-finite exactly when some element is (as in the host pass, detail/finalize.hpp).
//
// Deterministic: the grid does not depend on the GPU, each thread sums a fixed set of elements,
// blocks reduce in a fixed tree (CUB) and the last block adds the block sums in order, so every
// rank computes the same norm, bit for bit, and so clips alike. Needs nvcc.
#pragma once

#include <gradsync/cuda/check.hpp>
#include <gradsync/half.hpp>

#include <cub/block/block_reduce.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace gradsync::inline v0::cuda {

inline constexpr unsigned finalize_blocks = 1024;  // at most; fewer for small buckets
inline constexpr unsigned finalize_threads = 256;

// Device memory the pass needs, allocated once: a sum per block, a ticket that tells the last
// block it is last, and the result.
class FinalizeScratch {
public:
    FinalizeScratch() {
        GRADSYNC_CUDA_CHECK(cudaMalloc(&memory_, sizeof(double) * (finalize_blocks + 1) + sizeof(unsigned)));
        GRADSYNC_CUDA_CHECK(cudaMemset(memory_, 0, sizeof(double) * (finalize_blocks + 1) + sizeof(unsigned)));
    }
    FinalizeScratch(const FinalizeScratch&) = delete;
    FinalizeScratch& operator=(const FinalizeScratch&) = delete;
    ~FinalizeScratch() { cudaFree(memory_); }

    [[nodiscard]] double* block_sums() const { return static_cast<double*>(memory_); }
    // Where the sum of squares lands, in device memory: read it after the stream gets there.
    [[nodiscard]] double* sum() const { return block_sums() + finalize_blocks; }
    [[nodiscard]] unsigned* ticket() const { return reinterpret_cast<unsigned*>(sum() + 1); }

private:
    void* memory_ = nullptr;
};

namespace detail {

// The accumulator of a storage type: double for double, float for the rest, as on the host.
template <class T>
using device_accumulator_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
__device__ inline device_accumulator_t<T> widen(T v) {
    if constexpr (std::is_same_v<T, float16>)
        return __half2float(__ushort_as_half(v.bits));
    else if constexpr (std::is_same_v<T, bfloat16>)
        return __bfloat162float(__ushort_as_bfloat16(v.bits));
    else
        return v;
}

template <class T>
__device__ inline T narrow(device_accumulator_t<T> v) {
    T out{};
    if constexpr (std::is_same_v<T, float16>)
        out.bits = __half_as_ushort(__float2half_rn(v));
    else if constexpr (std::is_same_v<T, bfloat16>)
        out.bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
    else
        out = v;
    return out;
}

// Ends a pass that summed squares per thread: the block's sum goes to block_sums, and the last
// block to arrive adds them in block order into *sum, so the total does not depend on timing.
// Every thread of the block calls it.
__device__ inline void sum_over_blocks(double squares, double* block_sums, unsigned* ticket, double* sum) {
    using BlockReduce = cub::BlockReduce<double, finalize_threads>;
    __shared__ typename BlockReduce::TempStorage temp;
    __shared__ bool last;
    const double block = BlockReduce(temp).Sum(squares);
    if (threadIdx.x == 0) {
        block_sums[blockIdx.x] = block;
        __threadfence();  // the sum is visible before the ticket says so
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
        const volatile double* sums = block_sums;
        double total = 0;
        for (unsigned b = 0; b < gridDim.x; ++b) total += sums[b];
        *sum = total;
        *ticket = 0;  // ready for the next launch on this scratch
    }
}

template <class T>
__global__ void __launch_bounds__(finalize_threads)
    finalize_kernel(T* data, std::uint64_t n, device_accumulator_t<T> factor, double* block_sums, unsigned* ticket,
                    double* sum) {
    double squares = 0;
    const std::uint64_t stride = std::uint64_t(gridDim.x) * blockDim.x;
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const T written = narrow<T>(widen(data[i]) * factor);
        data[i] = written;
        const double w = static_cast<double>(widen(written));
        squares += w * w;
    }
    sum_over_blocks(squares, block_sums, ticket, sum);
}

}  // namespace detail

// Scales data[0, n) by `factor` in place on `stream` and leaves the sum of the squares of the
// results in *sum (device memory), by default *scratch.sum(). T is float, double, float16 or bfloat16; 16-bit values
// are scaled in float and rounded to nearest even once, as the host pass does. Launches on one scratch must not overlap
// (one stream does that).
template <class T>
void finalize(T* data, std::uint64_t n, double factor, FinalizeScratch& scratch, cudaStream_t stream,
              double* sum = nullptr) {
    const std::uint64_t wanted = (n + finalize_threads - 1) / finalize_threads;
    const unsigned blocks = wanted == 0 ? 1u : wanted < finalize_blocks ? unsigned(wanted) : finalize_blocks;
    detail::finalize_kernel<T><<<blocks, finalize_threads, 0, stream>>>(
        data, n, static_cast<detail::device_accumulator_t<T>>(factor), scratch.block_sums(), scratch.ticket(),
        sum != nullptr ? sum : scratch.sum());
    GRADSYNC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gradsync::inline v0::cuda
