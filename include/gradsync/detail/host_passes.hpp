// The fused finalize pass over reduced gradients: scale (1 / (world size x loss scale)), sum of
// squares for the global norm, and detection of non-finite values, in one read and one write of
// each element, widening or narrowing between storage types on the way.
#pragma once

#include <gradsync/detail/host_reduce.hpp>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>
#include <gradsync/version.hpp>

#include <algorithm>  // for std::min
#include <cmath>      // for std::isfinite
#include <cstddef>
#include <string>

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

// float16 values go through a float buffer of this many, converted in bulk (by F16C on x86-64).
// bfloat16 widens with a shift, which loops vectorize as they are; float narrowed to bfloat16 in
// the finalize pass goes through the buffer too (scale_copy_square_sum).
inline constexpr std::size_t conversion_chunk = 256;

template <class In, class Out>
inline constexpr bool via_float_buffer = std::is_same_v<In, float16> || std::is_same_v<Out, float16>;

// Reads n values of In as float into buf.
template <class In>
inline void load_float(const In* in, float* buf, std::size_t n) {
    if constexpr (is_16_bit<In>)
        widen_to_float(in, buf, n);
    else
        for (std::size_t i = 0; i < n; ++i) buf[i] = static_cast<float>(in[i]);
}

// Writes buf's n floats as Out. With `exact`, buf afterwards holds exactly what was written.
template <class Out>
inline void store_float(float* buf, Out* out, std::size_t n, bool exact) {
    if constexpr (std::is_same_v<Out, bfloat16>) {
        narrow_to_bfloat16(buf, out, n, exact ? buf : nullptr);
    } else if constexpr (is_16_bit<Out>) {
        narrow_from_float(buf, out, n);
        if (exact) widen_to_float(out, buf, n);
    } else {
        for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<Out>(buf[i]);
    }
}

inline void add_squares(const float* buf, std::size_t n, SquareSum& sums) {
    const std::size_t full = n - n % simd_width;
    std::size_t i = 0;
    for (; i < full; i += simd_width)
        for (std::size_t j = 0; j < simd_width; ++j) sums.lanes[j] += double(buf[i + j]) * double(buf[i + j]);
    for (; i < n; ++i) sums.lanes[0] += double(buf[i]) * double(buf[i]);
}

// The chunked path for 16-bit values: load as float, scale, store, measure what was stored. `in`
// may equal `out`: each chunk is read in full before it is written.
template <class In, class Out>
void scale_through_float(const In* in, Out* out, std::size_t n, double factor, SquareSum* sums) {
    alignas(64) float buf[conversion_chunk];
    const auto f = static_cast<float>(factor);
    for (std::size_t off = 0; off < n; off += conversion_chunk) {
        const std::size_t k = std::min(conversion_chunk, n - off);
        load_float(in + off, buf, k);
        if (f != 1.0f) scale_in_place(buf, f, k);
        store_float(buf, out + off, k, sums != nullptr);
        if (sums != nullptr) add_squares(buf, k, *sums);
    }
}

// out[i] = Out(in[i] * factor) for i < n, adding each out[i]'s square (as written, widened) to
// `sums`. In and Out may be float, double, float16 or bfloat16, in any combination.
template <class In, class Out>
void scale_copy_square_sum(const In* __restrict in, Out* __restrict out, std::size_t n, double factor,
                           SquareSum& sums) {
    // float to bfloat16 too: rounded in blocks, then the squares of what was written, runs at
    // twice the speed of the loop below (which compilers do not vectorize for it).
    if constexpr (via_float_buffer<In, Out> || (std::is_same_v<In, float> && std::is_same_v<Out, bfloat16>)) {
        return scale_through_float(in, out, n, factor, &sums);
    } else {
        using A = accumulator_t<Out>;  // double stays double; the rest scales in float
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
}

// The same in place: data[i] = T(data[i] * factor), squares added to `sums`.
template <class T>
void scale_square_sum(T* __restrict data, std::size_t n, double factor, SquareSum& sums) {
    if constexpr (via_float_buffer<T, T>) {
        return scale_through_float(data, data, n, factor, &sums);
    } else {
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
}

// Only reads: the squares of data[i], for when there is nothing to scale.
template <class T>
void square_sum(const T* __restrict data, std::size_t n, SquareSum& sums) {
    using A = accumulator_t<T>;
    if constexpr (via_float_buffer<T, T>) {
        alignas(64) float buf[conversion_chunk];
        for (std::size_t off = 0; off < n; off += conversion_chunk) {
            const std::size_t k = std::min(conversion_chunk, n - off);
            widen_to_float(data + off, buf, k);
            add_squares(buf, k, sums);
        }
    } else {
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
}

// out[i] = Out(in[i] * factor): packing with a conversion (compression) or a share.
template <class In, class Out>
void scale_copy(const In* __restrict in, Out* __restrict out, std::size_t n, double factor) {
    if constexpr (via_float_buffer<In, Out>) {
        return scale_through_float(in, out, n, factor, nullptr);
    } else {
        using A = accumulator_t<Out>;
        for (std::size_t i = 0; i < n; ++i)
            out[i] = Out(static_cast<A>(static_cast<A>(in[i]) * static_cast<A>(factor)));
    }
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
