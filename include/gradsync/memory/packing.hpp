// Whether DataParallel copies gradients into bucket buffers: a policy of its own, since the
// answer depends on the backend (one that reduces scattered memory needs no copy).
#pragma once

#include <gradsync/detail/policy.hpp>

#include <cstdint>
#include <string>

namespace gradsync::inline v0 {

enum class PackingMode : std::uint8_t {
    automatic,  // in place where the backend can (ScatteredAllreduce), packed where it cannot
    packed,     // always through bucket buffers
    in_place,   // never: the backend must reduce scattered memory
};

// Packing policies. By default DataParallel reduces gradients where they lie when the backend
// can (ScatteredAllreduce), and packs them into bucket buffers when it cannot.
struct AutoPacking {
    using policy_category = policy_category::packing;
    [[nodiscard]] std::string settings() const { return "automatic"; }
    static constexpr PackingMode mode = PackingMode::automatic;
};
// Always copy gradients into bucket buffers of the memory policy, allreduce those, copy back.
struct PackedBuckets {
    using policy_category = policy_category::packing;
    [[nodiscard]] std::string settings() const { return "packed"; }
    static constexpr PackingMode mode = PackingMode::packed;
};
// Never copy: reduce the gradient buffers themselves. Needs a ScatteredAllreduce backend.
struct InPlaceBuckets {
    using policy_category = policy_category::packing;
    [[nodiscard]] std::string settings() const { return "in place"; }
    static constexpr PackingMode mode = PackingMode::in_place;
};

}  // namespace gradsync::inline v0
