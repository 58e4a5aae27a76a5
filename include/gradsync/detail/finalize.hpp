// The fused finalize pass over reduced gradients: scale (1 / (world size x loss scale)), sum of
// squares for the global norm, and detection of non-finite values, in one read and one write of
// each element, widening or narrowing between storage types on the way.
#pragma once

#include <gradsync/detail/host_reduce.hpp>
#include <gradsync/half.hpp>
#include <gradsync/version.hpp>

#include <cmath>  // for std::isfinite
#include <cstddef>

namespace gradsync::inline v0::detail {

// Squares are summed in double, in simd_width lanes added in a fixed order, so the result is
// deterministic and a large finite gradient never overflows it: the sum is non-finite exactly
// when some element is.
struct SquareSum {
    double lanes[simd_width] = {};

    [[nodiscard]] double total() const {
        double t = 0;
        for (double l : lanes) t += l;
        return t;
    }
};

// out[i] = Out(in[i] * factor) for i < n, adding each out[i]'s square (as written, widened) to
// `sums`. In and Out may be float, double, float16 or bfloat16, in any combination.
template <class In, class Out>
void scale_copy_square_sum(const In* __restrict in, Out* __restrict out, std::size_t n, double factor,
                           SquareSum& sums) {
    using A = accumulator_t<Out>;  // double stays double; everything else scales in float
    const std::size_t full = n - n % simd_width;
    std::size_t i = 0;
    for (; i < full; i += simd_width) {
        for (std::size_t j = 0; j < simd_width; ++j) {
            const Out o = Out(static_cast<A>(static_cast<A>(in[i + j]) * static_cast<A>(factor)));
            out[i + j] = o;
            const double v = static_cast<double>(static_cast<A>(o));
            sums.lanes[j] += v * v;
        }
    }
    for (; i < n; ++i) {
        const Out o = Out(static_cast<A>(static_cast<A>(in[i]) * static_cast<A>(factor)));
        out[i] = o;
        const double v = static_cast<double>(static_cast<A>(o));
        sums.lanes[0] += v * v;
    }
}

// The same in place: data[i] = T(data[i] * factor), squares added to `sums`.
template <class T>
void scale_square_sum(T* __restrict data, std::size_t n, double factor, SquareSum& sums) {
    using A = accumulator_t<T>;
    const std::size_t full = n - n % simd_width;
    std::size_t i = 0;
    for (; i < full; i += simd_width) {
        for (std::size_t j = 0; j < simd_width; ++j) {
            const T o = T(static_cast<A>(static_cast<A>(data[i + j]) * static_cast<A>(factor)));
            data[i + j] = o;
            const double v = static_cast<double>(static_cast<A>(o));
            sums.lanes[j] += v * v;
        }
    }
    for (; i < n; ++i) {
        const T o = T(static_cast<A>(static_cast<A>(data[i]) * static_cast<A>(factor)));
        data[i] = o;
        const double v = static_cast<double>(static_cast<A>(o));
        sums.lanes[0] += v * v;
    }
}

// Only reads: the squares of data[i], for when there is nothing to scale.
template <class T>
void square_sum(const T* __restrict data, std::size_t n, SquareSum& sums) {
    using A = accumulator_t<T>;
    const std::size_t full = n - n % simd_width;
    std::size_t i = 0;
    for (; i < full; i += simd_width) {
        for (std::size_t j = 0; j < simd_width; ++j) {
            const double v = static_cast<double>(static_cast<A>(data[i + j]));
            sums.lanes[j] += v * v;
        }
    }
    for (; i < n; ++i) {
        const double v = static_cast<double>(static_cast<A>(data[i]));
        sums.lanes[0] += v * v;
    }
}

// out[i] = Out(in[i] * factor): packing with a conversion (compression) or a share.
template <class In, class Out>
void scale_copy(const In* __restrict in, Out* __restrict out, std::size_t n, double factor) {
    using A = accumulator_t<Out>;
    for (std::size_t i = 0; i < n; ++i) out[i] = Out(static_cast<A>(static_cast<A>(in[i]) * static_cast<A>(factor)));
}

// No infinity and no NaN among n float16 values: an exponent field of all ones is either.
inline bool all_finite(const float16* __restrict data, std::size_t n) {
    unsigned special = 0;
    for (std::size_t i = 0; i < n; ++i) special |= (data[i].bits & 0x7c00u) == 0x7c00u;
    return special == 0;
}

// Multiplies in place (gradient clipping's second pass).
template <class T>
void scale_only(T* __restrict data, std::size_t n, double factor) {
    using A = accumulator_t<T>;
    for (std::size_t i = 0; i < n; ++i) data[i] = T(static_cast<A>(static_cast<A>(data[i]) * static_cast<A>(factor)));
}

}  // namespace gradsync::inline v0::detail
