// PowerSGD's kernels (reduction/powersgd_cuda.cuh): each pass over a bucket's matrices is one
// launch over a table of them (blockIdx.y, or one block each, picks the matrix). They compute what
// PowerSGD does on the host (reduction/powersgd.hpp) in the same order per value, apart from the
// sums, which run as reductions over threads: the device and the host agree to rounding, and
// every rank's device computes bit for bit what the others do (no atomics in a value).
#pragma once

#include <gradsync/reduction/powersgd_config.hpp>

#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

namespace gradsync::inline v0::cuda {

// One compressed matrix of a bucket, as the kernels see it.
struct LowRankMatrix {
    std::uint64_t offset = 0;  // of M (n x m, row-major) in the bucket's values
    std::uint64_t n = 0, m = 0, r = 0;
    std::uint64_t p_at = 0, q_at = 0;  // of P^T (r x n) and Q^T (r x m) in the bucket's arrays of them
    std::uint64_t partial_at = 0;      // of its partial sums of M^T P (a chunk of rows each) in theirs
    float* error = nullptr;            // n x m, unscaled; null without error feedback
    float* q = nullptr;                // the Q^T carried from step to step (r x m)
};

// A parameter averaged exactly: `count` values from `from` in the bucket, at `to` in the array of
// them that one allreduce averages.
struct ExactRange {
    std::uint64_t from = 0, to = 0, count = 0;
};

namespace detail {

constexpr unsigned lowrank_threads = 256;
// Rows of M each block of the M^T P pass sums over: a tall matrix (an embedding) still spreads
// over many blocks, and the chunks' sums are added in a fixed order after.
constexpr std::uint64_t lowrank_rows_per_chunk = 128;

GRADSYNC_HOST_DEVICE inline std::uint64_t lowrank_chunks(std::uint64_t rows) {
    return (rows + lowrank_rows_per_chunk - 1) / lowrank_rows_per_chunk;
}

// Q^T drawn from `key` (detail::powersgd_uniform), `count` values.
template <class = void>
__global__ void lowrank_draw_kernel(float* q, std::uint64_t count, std::uint64_t key) {
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
         i += std::uint64_t(gridDim.x) * blockDim.x)
        q[i] = gradsync::detail::powersgd_uniform(key, i);
}

// The exact parameters into their array (to_array) or back into the bucket; blockIdx.y the range.
template <bool to_array>
__global__ void lowrank_exact_kernel(const ExactRange* ranges, float* values, float* array) {
    const ExactRange& e = ranges[blockIdx.y];
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < e.count;
         i += std::uint64_t(gridDim.x) * blockDim.x) {
        if constexpr (to_array)
            array[e.to + i] = values[e.from + i];
        else
            values[e.from + i] = array[e.to + i];
    }
}

// M += loss_scale x error (the error carried from the last step), then this rank's P = M Q: one
// warp per row, blockIdx.y the matrix.
template <class = void>
__global__ void lowrank_begin_kernel(const LowRankMatrix* table, float* values, float* ps, float loss_scale) {
    const LowRankMatrix& mx = table[blockIdx.y];
    const unsigned lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * warps + threadIdx.x / 32; i < mx.n;
         i += std::uint64_t(gridDim.x) * warps) {
        float* row = values + mx.offset + i * mx.m;
        if (mx.error != nullptr) {
            const float* error = mx.error + i * mx.m;
            for (std::uint64_t j = lane; j < mx.m; j += 32) row[j] += loss_scale * error[j];
            __syncwarp();
        }
        for (std::uint64_t k = 0; k < mx.r; ++k) {
            const float* q = mx.q + k * mx.m;
            float sum = 0;
            for (std::uint64_t j = lane; j < mx.m; j += 32) sum += row[j] * q[j];
            for (unsigned offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            if (lane == 0) ps[mx.p_at + k * mx.n + i] = sum;
        }
    }
}

// The sum of `value` over the block, on every thread (sums in double; `shared` is the block's).
template <class Reduce>
__device__ double block_sum(double value, typename Reduce::TempStorage& temp, double& shared) {
    const double total = Reduce(temp).Sum(value);
    if (threadIdx.x == 0) shared = total;
    __syncthreads();
    const double out = shared;
    __syncthreads();
    return out;
}

// The summed P's columns made orthonormal (Gram-Schmidt, twice, in double), one block per
// matrix; a column that vanishes is left zero. A value that is not finite (a rank's gradients
// overflowed) sets *nonfinite instead: every rank holds the same sums, so every rank sees it.
template <class = void>
__global__ void __launch_bounds__(lowrank_threads)
    lowrank_orthonormalize_kernel(const LowRankMatrix* table, float* ps, unsigned* nonfinite) {
    const LowRankMatrix& mx = table[blockIdx.x];
    float* pt = ps + mx.p_at;
    bool bad = false;
    for (std::uint64_t i = threadIdx.x; i < mx.n * mx.r; i += blockDim.x) bad = bad || !isfinite(pt[i]);
    if (__syncthreads_or(bad)) {
        if (threadIdx.x == 0) *nonfinite = 1;
        return;
    }
    using Reduce = cub::BlockReduce<double, lowrank_threads>;
    __shared__ typename Reduce::TempStorage temp;
    __shared__ double shared;
    for (std::uint64_t k = 0; k < mx.r; ++k) {
        float* col = pt + k * mx.n;
        for (int pass = 0; pass < 2; ++pass)
            for (std::uint64_t c = 0; c < k; ++c) {
                const float* other = pt + c * mx.n;
                double dot = 0;
                for (std::uint64_t i = threadIdx.x; i < mx.n; i += blockDim.x) dot += double(col[i]) * other[i];
                dot = block_sum<Reduce>(dot, temp, shared);
                for (std::uint64_t i = threadIdx.x; i < mx.n; i += blockDim.x)
                    col[i] = float(double(col[i]) - dot * other[i]);
                __syncthreads();
            }
        double norm = 0;
        for (std::uint64_t i = threadIdx.x; i < mx.n; i += blockDim.x) norm += double(col[i]) * col[i];
        norm = sqrt(block_sum<Reduce>(norm, temp, shared));
        for (std::uint64_t i = threadIdx.x; i < mx.n; i += blockDim.x) col[i] = norm > 0 ? float(col[i] / norm) : 0.0f;
        __syncthreads();
    }
}

// This rank's Q = M^T P, first as partial sums over chunks of rows: one thread per column of M,
// four columns of P at a time; blockIdx.y the chunk, blockIdx.z the matrix. Partial sum (c, k, j)
// lies at partial_at + (c r + k) m + j.
template <class = void>
__global__ void lowrank_project_kernel(const LowRankMatrix* table, const float* values, const float* ps,
                                       float* partials) {
    const LowRankMatrix& mx = table[blockIdx.z];
    const std::uint64_t chunk = blockIdx.y;
    if (chunk >= lowrank_chunks(mx.n)) return;
    const std::uint64_t first = chunk * lowrank_rows_per_chunk;
    const std::uint64_t last = first + lowrank_rows_per_chunk < mx.n ? first + lowrank_rows_per_chunk : mx.n;
    const float* M = values + mx.offset;
    const float* pt = ps + mx.p_at;
    float* out = partials + mx.partial_at + chunk * mx.r * mx.m;
    for (std::uint64_t j = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < mx.m;
         j += std::uint64_t(gridDim.x) * blockDim.x)
        for (std::uint64_t k = 0; k < mx.r; k += 4) {
            float sum[4] = {0, 0, 0, 0};
            for (std::uint64_t i = first; i < last; ++i) {
                const float v = M[i * mx.m + j];
#pragma unroll
                for (std::uint64_t l = 0; l < 4; ++l)
                    if (k + l < mx.r) sum[l] += v * pt[(k + l) * mx.n + i];
            }
#pragma unroll
            for (std::uint64_t l = 0; l < 4; ++l)
                if (k + l < mx.r) out[(k + l) * mx.m + j] = sum[l];
        }
}

// Q^T as the sum of the chunks' partial sums, in chunk order; blockIdx.y the matrix.
template <class = void>
__global__ void lowrank_sum_chunks_kernel(const LowRankMatrix* table, const float* partials, float* qs) {
    const LowRankMatrix& mx = table[blockIdx.y];
    const std::uint64_t count = mx.r * mx.m, chunks = lowrank_chunks(mx.n);
    const float* in = partials + mx.partial_at;
    for (std::uint64_t e = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
         e += std::uint64_t(gridDim.x) * blockDim.x) {
        float sum = 0;
        for (std::uint64_t c = 0; c < chunks; ++c) sum += in[c * count + e];
        qs[mx.q_at + e] = sum;
    }
}

// Sets *nonfinite when one of n values is an infinity or NaN.
template <class = void>
__global__ void lowrank_nonfinite_kernel(const float* data, std::uint64_t n, unsigned* nonfinite) {
    bool found = false;
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += std::uint64_t(gridDim.x) * blockDim.x)
        found = found || !isfinite(data[i]);
    if (__syncthreads_or(found) && threadIdx.x == 0) *nonfinite = 1;
}

// The gradient becomes P Q^T x share; the error keeps what that left out of this rank's (times
// unscale); with warm start the carried Q becomes this step's. Where a sum was not finite, the
// gradient is left NaN (a step that measures it skips) and the error and Q stay as they were.
// blockIdx.y the matrix.
template <class = void>
__global__ void lowrank_approximate_kernel(const LowRankMatrix* table, float* values, const float* ps, const float* qs,
                                           float share, float unscale, bool warm_start, const unsigned* nonfinite) {
    const LowRankMatrix& mx = table[blockIdx.y];
    float* M = values + mx.offset;
    const float* pt = ps + mx.p_at;
    const float* qt = qs + mx.q_at;
    const bool bad = *nonfinite != 0;
    const std::uint64_t first = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const std::uint64_t stride = std::uint64_t(gridDim.x) * blockDim.x;
    for (std::uint64_t e = first; e < mx.n * mx.m; e += stride) {
        if (bad) {
            M[e] = __int_as_float(0x7fc00000);  // quiet NaN
            continue;
        }
        const std::uint64_t i = e / mx.m, j = e % mx.m;
        float approx = 0;
        for (std::uint64_t k = 0; k < mx.r; ++k) approx += (pt[k * mx.n + i] * share) * qt[k * mx.m + j];
        if (mx.error != nullptr) mx.error[e] = (M[e] - approx) * unscale;
        M[e] = approx;
    }
    if (bad || !warm_start) return;
    for (std::uint64_t e = first; e < mx.r * mx.m; e += stride) mx.q[e] = qt[e];
}

}  // namespace detail

}  // namespace gradsync::inline v0::cuda
