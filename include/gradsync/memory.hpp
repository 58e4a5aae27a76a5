// The memory layer under the buckets: where a packed bucket's bytes live (HostMemory here; device
// memory with a stream in the CUDA headers) and whether gradients are packed at all.
#pragma once

#include <gradsync/backend.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/detail/aligned_bytes.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/dtype.hpp>

#include <cstddef>
#include <cstring>  // for std::memcpy
#include <span>

namespace gradsync::inline v0 {

// Bucket buffers in host memory, allocated and touched once, never per step.
struct HostMemory {
    using policy_category = policy_category::memory;
    using Storage = detail::AlignedBytes;

    static Storage allocate(Bytes size) { return Storage(size.count()); }
    static std::byte* data(const Storage& s) { return s.data(); }

    // Copies the segments one after another into `dst`.
    static void pack(std::byte* dst, std::span<const Segment> src, DType t) {
        const std::size_t elem = size_of(t);
        for (const auto& s : src) {
            std::memcpy(dst, s.data, s.count * elem);
            dst += s.count * elem;
        }
    }
    // Copies consecutive bytes of `src` back into the segments.
    static void unpack(std::span<const Segment> dst, const std::byte* src, DType t) {
        const std::size_t elem = size_of(t);
        for (const auto& s : dst) {
            std::memcpy(s.data, src, s.count * elem);
            src += s.count * elem;
        }
    }
};

// Packing policies. By default DataParallel reduces gradients where they lie when the backend
// can (ScatteredAllreduce), and packs them into bucket buffers when it cannot.
struct AutoPacking {
    using policy_category = policy_category::packing;
};
// Always copy gradients into bucket buffers of the memory policy, allreduce those, copy back.
struct PackedBuckets {
    using policy_category = policy_category::packing;
};
// Never copy: reduce the gradient buffers themselves. Needs a ScatteredAllreduce backend.
struct InPlaceBuckets {
    using policy_category = policy_category::packing;
};

}  // namespace gradsync::inline v0
