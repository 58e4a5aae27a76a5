// The fused finalize pass on the device: data[i] = T(data[i] * factor) in place (1 / (world size x
// loss scale)), and the sum of the squares of the values written, for the global norm, in one
// read and one write of each element and one launch. Non-finite values need no flag of their
// own: squares are summed in double, where no finite gradient overflows, so the sum is
// non-finite exactly when some element is (as in the host pass, detail/finalize.hpp).
//
// Deterministic: the grid does not depend on the GPU, each thread sums a fixed set of elements,
// blocks reduce in a fixed tree (CUB) and the last block adds the block sums in another fixed
// tree, so every rank computes the same norm, bit for bit, and so clips alike. Loads and stores move 16 bytes
// where the data allow, several per thread in flight. Needs nvcc.
#pragma once

#include <gradsync/cuda/check.hpp>
#include <gradsync/cuda/convert.cuh>
#include <gradsync/half.hpp>

#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>  // for std::conditional_t, std::is_same_v

namespace gradsync::inline v0::cuda {

// At most; fewer for small buckets. Few enough to run as one wave on a current GPU at this kernel's
// register use (on an H200, 1024 blocks ran as 1.3 waves at 0.86 of a device copy's speed, 528 at
// 0.93); fixed, not taken from the GPU, so that every rank sums alike.
inline constexpr unsigned finalize_blocks = 512;
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

// Ends a pass that summed squares per thread: the block's sum goes to block_sums, and the last
// block to arrive adds them into *sum with all its threads (thread t takes blocks t, t + threads,
// ... in order, then the same fixed tree), so the total depends on the grid only, never on
// timing, and no thread adds up to a thousand sums alone. Every thread of the block calls it.
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
    if (!last) return;  // the same for every thread of the block
    const volatile double* sums = block_sums;
    double part = 0;
    for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) part += sums[b];
    __syncthreads();  // `temp` is reused
    const double total = BlockReduce(temp).Sum(part);
    if (threadIdx.x == 0) {
        *sum = total;
        *ticket = 0;  // ready for the next launch on this scratch
    }
}

// A fixed group of elements that moves as one load and one store (8 or 16 bytes).
template <class X, int N>
struct alignas(sizeof(X) * N) Lanes {
    X v[N];
};

// Chunks each thread keeps in flight: all their loads are issued before any store.
inline constexpr int finalize_unroll = 4;

template <class X, int N>
__device__ inline Lanes<X, N> load_lanes(const X* p, bool vector) {
    if (vector) return *reinterpret_cast<const Lanes<X, N>*>(p);
    Lanes<X, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = p[k];
    return out;
}

template <class X, int N>
__device__ inline void store_lanes(X* p, const Lanes<X, N>& in, bool vector) {
    if (vector) {
        *reinterpret_cast<Lanes<X, N>*>(p) = in;
        return;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = in.v[k];
}

// The finalize pass over n elements: dst[i] = T(widen(src[i]) * factor), from `src` (the reduced
// bucket, of S) or, when it is null, from dst itself (S = T); `write` false only measures. The
// squares of the values written join `squares`. The elements are taken in chunks of V = 16 /
// sizeof(T) consecutive ones, chunk c by thread c % threads (this one is `thread`), each thread's
// chunks in order: which thread sums what depends on n and the thread count only, never on where
// the data lie, so every rank sums alike, bit for bit. A chunk moves as one vector where the
// pointers allow, and each thread keeps finalize_unroll chunks in flight.
template <class S, class T, int U = finalize_unroll>
__device__ inline void finalize_range(T* __restrict__ dst, const S* __restrict__ src, std::uint64_t n,
                                      device_accumulator_t<T> factor, bool write, std::uint64_t thread,
                                      std::uint64_t threads, double& squares) {
    using A = device_accumulator_t<T>;
    constexpr int V = 16 / sizeof(T);
    const S* from = src;
    if constexpr (std::is_same_v<S, T>) {
        if (from == nullptr) from = dst;
    }
    const auto value = [&](S in) -> T {
        if constexpr (std::is_same_v<S, T>) {
            if (!write) return in;
        }
        return narrow<T>(A(widen(in)) * factor);
    };
    const std::uint64_t chunks = n / V;
    const bool vector = reinterpret_cast<std::uintptr_t>(dst) % 16 == 0 &&
                        reinterpret_cast<std::uintptr_t>(from) % (sizeof(S) * V) == 0;
    for (std::uint64_t first = thread; first < chunks; first += U * threads) {
        Lanes<S, V> in[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const std::uint64_t c = first + std::uint64_t(u) * threads;
            if (c < chunks) in[u] = load_lanes<S, V>(from + c * V, vector);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const std::uint64_t c = first + std::uint64_t(u) * threads;
            if (c >= chunks) continue;
            Lanes<T, V> out;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                out.v[k] = value(in[u].v[k]);
                const double w = static_cast<double>(widen(out.v[k]));
                squares += w * w;
            }
            if (write) store_lanes<T, V>(dst + c * V, out, vector);
        }
    }
    // Fewer than V elements are left: one each for the first threads.
    const std::uint64_t i = chunks * V + thread;
    if (thread < V && i < n) {
        const T written = value(from[i]);
        if (write) dst[i] = written;
        const double w = static_cast<double>(widen(written));
        squares += w * w;
    }
}

template <class T>
__global__ void __launch_bounds__(finalize_threads)
    finalize_kernel(T* data, std::uint64_t n, device_accumulator_t<T> factor, double* block_sums, unsigned* ticket,
                    double* sum) {
    double squares = 0;
    finalize_range<T, T>(data, nullptr, n, factor, true, std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                         std::uint64_t(gridDim.x) * blockDim.x, squares);
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
