// Wire compression: float32 gradients travel as float16 or bfloat16, converted while packing and
// widened again in the finalize pass, halving the bytes every collective moves.
#pragma once

#include <gradsync/detail/policy.hpp>
#include <gradsync/dtype.hpp>

#include <concepts>  // for std::convertible_to
#include <string>

namespace gradsync::inline v0 {

// Gradients travel in their own dtype. The default.
struct NoCompression {
    using policy_category = policy_category::compression;
    [[nodiscard]] std::string settings() const { return to_string(wire) + " on the wire"; }
    static constexpr DType wire = DType::float32;
    static constexpr bool compresses = false;
};

// float32 buckets travel as float16. Each rank sends its gradient divided by the world size, so
// the sum keeps the loss scale's headroom; a bucket whose float16 sum overflows is reduced again
// in float32, so compression never overflows where float32 would not.
struct Fp16Compression {
    using policy_category = policy_category::compression;
    [[nodiscard]] std::string settings() const { return to_string(wire) + " on the wire"; }
    static constexpr DType wire = DType::float16;
    static constexpr bool compresses = true;
};

// float32 buckets travel as bfloat16: float32's range, 8 bits of precision.
struct Bf16Compression {
    using policy_category = policy_category::compression;
    [[nodiscard]] std::string settings() const { return to_string(wire) + " on the wire"; }
    static constexpr DType wire = DType::bfloat16;
    static constexpr bool compresses = true;
};

// What DataParallel needs of a wire compression policy: the dtype float32 gradients travel in,
// and whether that is a compression at all.
template <class C>
concept WireCompression = detail::has_settings<C> && requires {
    { C::wire } -> std::convertible_to<DType>;
    { C::compresses } -> std::convertible_to<bool>;
};

namespace detail {

template <class C>
constexpr bool check_compression() {
    static_assert(
        requires {
            { C::wire } -> std::convertible_to<DType>;
        },
        "gradsync: a compression policy needs `static constexpr gradsync::DType wire`, the dtype float32 "
        "gradients travel in");
    static_assert(
        requires {
            { C::compresses } -> std::convertible_to<bool>;
        },
        "gradsync: a compression policy needs `static constexpr bool compresses`");
    return true;
}

}  // namespace detail

}  // namespace gradsync::inline v0
