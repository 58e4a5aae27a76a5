// Pack and unpack a whole bucket in one kernel launch, from a device-side table of its tensors
// (cuda/bucket_table.hpp): many small tensors must not mean many launches. Each block copies one
// tile of the bucket; a tensor larger than a tile is shared by several blocks; pieces whose two
// ends are aligned alike move 16 bytes at a time, several per thread in flight. Needs nvcc.
#pragma once

#include <gradsync/memory/cuda/bucket_table.hpp>
#include <gradsync/cuda/check.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace gradsync::inline v0::cuda {

// Elements per block: enough work per block to hide the table walk, few enough blocks that a
// 1 MiB bucket still fills the GPU.
inline constexpr std::uint64_t pack_tile = 8192;
inline constexpr int pack_threads = 256;

namespace detail {

// Vectors each thread keeps in flight while copying: all loaded before any is stored.
inline constexpr int copy_unroll = 4;

// Copies n elements from src to dst with the threads of one block: 16 bytes per load and store
// where both lie alike relative to a 16-byte boundary (a head of single elements takes them
// there), element by element otherwise. Consecutive threads take consecutive pieces, so both
// ways stay coalesced.
template <class T>
__device__ inline void copy_piece(T* __restrict__ dst, const T* __restrict__ src, std::uint64_t n) {
    if constexpr (sizeof(T) < 16) {
        constexpr std::uint64_t per_vector = 16 / sizeof(T);
        const auto d = reinterpret_cast<std::uintptr_t>(dst);
        const auto s = reinterpret_cast<std::uintptr_t>(src);
        if ((d - s) % 16 == 0 && n >= 2 * per_vector) {
            const std::uint64_t head = ((16 - d % 16) % 16) / sizeof(T);
            for (std::uint64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
            const std::uint64_t vectors = (n - head) / per_vector;
            auto* __restrict__ vd = reinterpret_cast<uint4*>(dst + head);
            const auto* __restrict__ vs = reinterpret_cast<const uint4*>(src + head);
            const std::uint64_t threads = blockDim.x;
            for (std::uint64_t first = threadIdx.x; first < vectors; first += copy_unroll * threads) {
                uint4 v[copy_unroll];
#pragma unroll
                for (int u = 0; u < copy_unroll; ++u) {
                    const std::uint64_t i = first + std::uint64_t(u) * threads;
                    if (i < vectors) v[u] = vs[i];
                }
#pragma unroll
                for (int u = 0; u < copy_unroll; ++u) {
                    const std::uint64_t i = first + std::uint64_t(u) * threads;
                    if (i < vectors) vd[i] = v[u];
                }
            }
            for (std::uint64_t i = head + vectors * per_vector + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
            return;
        }
    }
    for (std::uint64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// Copies between the tensors and the bucket; `to_bucket` chooses the direction.
template <class T, bool to_bucket>
__global__ void copy_bucket(const Segment* table, std::size_t segments, T* bucket, std::uint64_t total) {
    const std::uint64_t begin = std::uint64_t(blockIdx.x) * pack_tile;
    const std::uint64_t end = begin + pack_tile < total ? begin + pack_tile : total;
    for_each_piece(table, segments, begin, end,
                   [&](std::size_t s, std::uint64_t in_tensor, std::uint64_t in_bucket, std::uint64_t n) {
                       T* tensor = static_cast<T*>(table[s].data) + in_tensor;
                       T* packed = bucket + in_bucket;
                       if constexpr (to_bucket)
                           copy_piece(packed, tensor, n);
                       else
                           copy_piece(tensor, packed, n);
                   });
}

template <class T, bool to_bucket>
void launch_copy(std::span<const Segment> device_table, T* bucket, std::uint64_t total, cudaStream_t stream) {
    if (total == 0) return;
    const std::uint64_t blocks = (total + pack_tile - 1) / pack_tile;
    copy_bucket<T, to_bucket><<<static_cast<unsigned>(blocks), pack_threads, 0, stream>>>(
        device_table.data(), device_table.size(), bucket, total);
    GRADSYNC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace detail

// Copies every tensor of the table into `bucket` (total elements) on `stream`; the table itself
// must be in device memory. T is any type of the element's size: the copy does not convert.
template <class T>
void pack(std::span<const Segment> device_table, T* bucket, std::uint64_t total, cudaStream_t stream) {
    detail::launch_copy<T, true>(device_table, bucket, total, stream);
}

// The reverse: the bucket's elements back into the tensors.
template <class T>
void unpack(std::span<const Segment> device_table, T* bucket, std::uint64_t total, cudaStream_t stream) {
    detail::launch_copy<T, false>(device_table, bucket, total, stream);
}

}  // namespace gradsync::inline v0::cuda
