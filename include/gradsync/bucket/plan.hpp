// A bucket plan: which parameters are reduced together, in which order. A BucketPlan is a value
// (==, hash, printer), the same on every rank for the same layout and policy, so it can be logged
// at start-up, compared across ranks and asserted in tests.
#pragma once

#include <gradsync/bytes.hpp>
#include <gradsync/detail/hash.hpp>
#include <gradsync/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>  // for std::hash
#include <ostream>
#include <sstream>  // for std::ostringstream
#include <string>
#include <vector>

namespace gradsync::inline v0 {

// One fusion buffer: parameters of a single dtype, reduced together by one collective.
// `parameters` are in the order they are expected to become ready; the collective itself lays
// the elements out by parameter index, the same on every rank whatever the memory layout.
struct Bucket {
    DType dtype = DType::float32;
    std::vector<std::size_t> parameters;  // indices into the parameter list, in readiness order
    std::size_t count = 0;                // elements in all of them

    [[nodiscard]] Bytes bytes() const { return Bytes{count * size_of(dtype)}; }
    friend bool operator==(const Bucket&, const Bucket&) = default;
};

// The buckets in launch order: the order in which every rank starts their allreduces.
struct BucketPlan {
    std::vector<Bucket> buckets;

    [[nodiscard]] Bytes bytes() const {
        Bytes total;
        for (const auto& b : buckets) total += b.bytes();
        return total;
    }
    // Over (dtype, count, parameter indices) of every bucket: the same in every process.
    [[nodiscard]] std::uint64_t hash() const {
        detail::Fnv1a h;
        h.add(buckets.size());
        for (const auto& b : buckets) {
            h.add(static_cast<std::uint64_t>(b.dtype)).add(b.count).add(b.parameters.size());
            for (auto p : b.parameters) h.add(p);
        }
        return h.value();
    }
    friend bool operator==(const BucketPlan&, const BucketPlan&) = default;
};

// "3 buckets, 97.5 MiB: [0] float32 1.0 MiB, 4 params (160..157) ..."
inline std::ostream& operator<<(std::ostream& os, const BucketPlan& plan) {
    os << plan.buckets.size() << " bucket" << (plan.buckets.size() == 1 ? "" : "s") << ", " << plan.bytes();
    for (std::size_t i = 0; i < plan.buckets.size(); ++i) {
        const auto& b = plan.buckets[i];
        os << "\n  [" << i << "] " << b.dtype << ' ' << b.bytes() << ", " << b.parameters.size() << " param"
           << (b.parameters.size() == 1 ? "" : "s");
        if (!b.parameters.empty()) {
            os << " (" << b.parameters.front();
            if (b.parameters.size() > 1) os << ".." << b.parameters.back();
            os << ')';
        }
    }
    return os;
}

inline std::string to_string(const BucketPlan& plan) {
    std::ostringstream os;
    os << plan;
    return os.str();
}

}  // namespace gradsync::inline v0

template <>
struct std::hash<gradsync::BucketPlan> {
    std::size_t operator()(const gradsync::BucketPlan& plan) const noexcept {
        return static_cast<std::size_t>(plan.hash());
    }
};
