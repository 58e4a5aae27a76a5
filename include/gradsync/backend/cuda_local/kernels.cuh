// The kernel of CudaLocalBackend: every rank's device buffer reduced in rank order by one launch.
// Needs nvcc.
#pragma once

#include <gradsync/cuda/convert.cuh>

#include <cuda_runtime.h>

#include <cstdint>

namespace gradsync::inline v0::cuda::detail {

inline constexpr int max_local_ranks = 8;

struct RankPointers {
    void* at[max_local_ranks];
};

// The rank whose shard (gradsync::shard_of) holds element i of n: the first n % ranks shards are
// one element longer.
__device__ inline int shard_owner(std::uint64_t i, std::uint64_t n, int ranks) {
    const std::uint64_t base = n / std::uint64_t(ranks), longer = n % std::uint64_t(ranks);
    const std::uint64_t boundary = longer * (base + 1);
    return i < boundary ? int(i / (base + 1)) : int(longer + (i - boundary) / base);
}

// For every element: the sum over the ranks' buffers in rank order, in the accumulator type,
// times `factor` when `scaled`, written back to every rank's buffer (an allreduce) or to the
// owner's only (a reduce_scatter). The loops over the ranks are unrolled to the most there can
// be, so the pointer table stays in the kernel's parameters instead of being copied to local
// memory for indexing at run time.
template <class T>
__global__ void reduce_ranks_kernel(RankPointers ptrs, int ranks, std::uint64_t n, bool scaled,
                                    device_accumulator_t<T> factor, bool owner_only) {
    using A = device_accumulator_t<T>;
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += std::uint64_t(gridDim.x) * blockDim.x) {
        A sum = widen(static_cast<const T*>(ptrs.at[0])[i]);
#pragma unroll
        for (int r = 1; r < max_local_ranks; ++r)
            if (r < ranks) sum += widen(static_cast<const T*>(ptrs.at[r])[i]);
        const T out = narrow<T>(scaled ? sum * factor : sum);
        const int owner = owner_only ? shard_owner(i, n, ranks) : -1;
#pragma unroll
        for (int r = 0; r < max_local_ranks; ++r)
            if (r < ranks && (owner < 0 || r == owner)) static_cast<T*>(ptrs.at[r])[i] = out;
    }
}

}  // namespace gradsync::inline v0::cuda::detail
