// Where a bucket's elements come from: a table of (tensor, count, offset), and the walk that
// splits any range of the bucket into per-tensor pieces. The pack and unpack kernels
// (cuda/pack.cuh) give each thread block one tile of the bucket and walk it with
// for_each_piece, so a bucket of many small tensors is one launch, and one huge tensor is shared
// by many blocks. Plain C++ that also compiles for the device, so the host tests cover the walk.
#pragma once

#include <gradsync/detail/host_device.hpp>
#include <gradsync/version.hpp>

#include <cstddef>
#include <cstdint>

namespace gradsync::inline v0::cuda {

// One tensor of a bucket: its elements start at `data` and at element `offset` of the bucket.
// Offsets ascend and tensors do not overlap; zero-count tensors are allowed.
struct Segment {
    void* data = nullptr;
    std::uint64_t count = 0;
    std::uint64_t offset = 0;
};

// The last segment whose offset is at most `position` (binary search); 0 for an empty table.
GRADSYNC_HOST_DEVICE inline std::size_t segment_at(const Segment* table, std::size_t segments, std::uint64_t position) {
    std::size_t low = 0, high = segments;  // answer in [low, high)
    while (high - low > 1) {
        const std::size_t mid = low + (high - low) / 2;
        if (table[mid].offset <= position)
            low = mid;
        else
            high = mid;
    }
    return low;
}

// Calls fn(segment, first element in the segment, first element in the bucket, length) for every
// non-empty piece of the bucket range [begin, end), in order.
template <class Fn>
GRADSYNC_HOST_DEVICE void for_each_piece(const Segment* table, std::size_t segments, std::uint64_t begin,
                                         std::uint64_t end, Fn&& fn) {
    for (std::size_t s = segment_at(table, segments, begin); s < segments && table[s].offset < end; ++s) {
        const std::uint64_t first = table[s].offset > begin ? table[s].offset : begin;
        const std::uint64_t stop = table[s].offset + table[s].count < end ? table[s].offset + table[s].count : end;
        if (first < stop) fn(s, first - table[s].offset, first, stop - first);
    }
}

}  // namespace gradsync::inline v0::cuda
