// float16 and bfloat16: portable 16-bit floating-point storage types for the host, with
// round-to-nearest-even conversions, bit-compatible with CUDA's __half and __nv_bfloat16.
// They store and convert; arithmetic happens in float.
#pragma once

#include <gradsync/dtype.hpp>
#include <gradsync/version.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>      // for std::memcpy
#include <type_traits>  // for std::is_same_v
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#include <cpuid.h>  // for __get_cpuid
#endif

namespace gradsync::inline v0 {

namespace detail {

inline std::uint32_t bits_of(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
inline float float_of(std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// IEEE binary16 from binary32, rounding to nearest even; overflow gives infinity, NaN stays NaN.
// Every case is computed and one selected, without branches, so that loops over it vectorize.
inline std::uint16_t half_bits_from_float(float value) {
    const std::uint32_t u = bits_of(value);
    const std::uint32_t sign = u & 0x80000000u;
    const std::uint32_t f = u ^ sign;
    // Normal: rebias the exponent (-112 << 23) and round to nearest even; a carry out of the
    // mantissa correctly reaches infinity.
    const std::uint32_t normal = (f + 0xc8000fffu + ((f >> 13) & 1u)) >> 13;
    // Below 2^-14, subnormal or zero: adding 0.5 aligns the 10 mantissa bits at the bottom and
    // the FPU rounds to nearest even.
    const std::uint32_t subnormal = bits_of(float_of(f) + 0.5f) - 0x3f000000u;
    const std::uint32_t special = f > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN (made quiet), infinity
    const std::uint32_t out = f >= 0x47800000u ? special : (f < 0x38800000u ? subnormal : normal);
    return static_cast<std::uint16_t>(out | (sign >> 16));
}

inline float float_from_half_bits(std::uint16_t h) {
    const std::uint32_t shifted = (static_cast<std::uint32_t>(h) & 0x7fffu) << 13;
    const std::uint32_t exponent = shifted & 0x0f800000u;
    const std::uint32_t normal = shifted + 0x38000000u;  // rebias (127 - 15) << 23
    const std::uint32_t special = normal + 0x38000000u;  // infinity or NaN
    const std::uint32_t subnormal = bits_of(float_of(normal + 0x00800000u) - float_of(0x38800000u));
    const std::uint32_t u = exponent == 0x0f800000u ? special : (exponent == 0 ? subnormal : normal);
    return float_of(u | (static_cast<std::uint32_t>(h) & 0x8000u) << 16);
}

// bfloat16 from binary32, rounding to nearest even; NaN stays a (quiet) NaN.
inline std::uint16_t bfloat16_bits_from_float(float value) {
    const std::uint32_t f = bits_of(value);
    const std::uint32_t rounded = (f + 0x7fffu + ((f >> 16) & 1u)) >> 16;
    const std::uint32_t nan = (f >> 16) | 0x0040u;
    return static_cast<std::uint16_t>((f & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline float float_from_bfloat16_bits(std::uint16_t b) { return float_of(static_cast<std::uint32_t>(b) << 16); }

}  // namespace detail

// IEEE 754 binary16.
struct float16 {
    std::uint16_t bits = 0;

    float16() = default;
    explicit float16(float f) : bits(detail::half_bits_from_float(f)) {}
    static float16 from_bits(std::uint16_t b) {
        float16 h;
        h.bits = b;
        return h;
    }
    explicit operator float() const { return detail::float_from_half_bits(bits); }
    friend bool operator==(float16 a, float16 b) { return a.bits == b.bits; }
};

// The upper half of a binary32: its range, 8 bits of precision.
struct bfloat16 {
    std::uint16_t bits = 0;

    bfloat16() = default;
    explicit bfloat16(float f) : bits(detail::bfloat16_bits_from_float(f)) {}
    static bfloat16 from_bits(std::uint16_t b) {
        bfloat16 h;
        h.bits = b;
        return h;
    }
    explicit operator float() const { return detail::float_from_bfloat16_bits(bits); }
    friend bool operator==(bfloat16 a, bfloat16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(float16) == 2 && alignof(float16) == 2, "float16 must be layout-compatible with __half");
static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2, "bfloat16 must be layout-compatible with __nv_bfloat16");

namespace detail {

template <class T>
inline constexpr bool is_16_bit = std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>;

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define GRADSYNC_F16C 1
// The F16C instructions convert 8 values at once, rounding to nearest even like the code above.
// Chosen at run time, so that a build for any x86-64 uses them where the processor has them.
inline bool has_f16c() {
    // F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
    static const bool yes = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & (1u << 29)) != 0;
    }();
    return yes;
}
// The compiler's builtins rather than <immintrin.h>, which alone costs every translation unit
// that includes gradsync almost a second of parsing.
using f16c_floats = float __attribute__((vector_size(32)));
using f16c_halves = short __attribute__((vector_size(16)));
__attribute__((target("f16c,avx"))) inline void narrow_f16c(const float* in, float16* out, std::size_t n) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        f16c_floats wide;
        std::memcpy(&wide, in + i, sizeof wide);
        const f16c_halves h = __builtin_ia32_vcvtps2ph256(wide, 0);  // 0: round to nearest even
        std::memcpy(static_cast<void*>(out + i), &h, sizeof h);
    }
    for (; i < n; ++i) out[i] = float16(in[i]);
}
__attribute__((target("f16c,avx"))) inline void widen_f16c(const float16* in, float* out, std::size_t n) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        f16c_halves h;
        std::memcpy(&h, in + i, sizeof h);
        const f16c_floats wide = __builtin_ia32_vcvtph2ps256(h);
        std::memcpy(out + i, &wide, sizeof wide);
    }
    for (; i < n; ++i) out[i] = static_cast<float>(in[i]);
}
#endif

// Conversions between float and bfloat16 over whole arrays, in blocks of a fixed size, which
// compilers vectorize (GCC's -O2 cost model vectorizes no loop that needs an epilogue; element by
// element the conversions run at half the speed or less there).
inline void widen_from_bfloat16(const bfloat16* __restrict in, float* __restrict out, std::size_t n) {
    std::size_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (std::size_t j = 0; j < 64; ++j) out[i + j] = float_from_bfloat16_bits(in[i + j].bits);
    for (; i < n; ++i) out[i] = float_from_bfloat16_bits(in[i].bits);
}
// `written` (may be `in`; null: none) receives the values written, as floats.
inline void narrow_to_bfloat16(const float* in, bfloat16* out, std::size_t n, float* written = nullptr) {
    std::size_t i = 0;
    if (written != nullptr) {
        for (; i + 64 <= n; i += 64)
            for (std::size_t j = 0; j < 64; ++j) {
                const std::uint16_t b = bfloat16_bits_from_float(in[i + j]);
                out[i + j].bits = b;
                written[i + j] = float_from_bfloat16_bits(b);
            }
    } else {
        for (; i + 64 <= n; i += 64)
            for (std::size_t j = 0; j < 64; ++j) out[i + j].bits = bfloat16_bits_from_float(in[i + j]);
    }
    for (; i < n; ++i) {
        out[i].bits = bfloat16_bits_from_float(in[i]);
        if (written != nullptr) written[i] = float_from_bfloat16_bits(out[i].bits);
    }
}

// Bulk conversions between float and a 16-bit type (hardware-assisted for float16 on x86-64,
// blocked for bfloat16).
template <class S>
inline void widen_to_float(const S* in, float* out, std::size_t n) {
#ifdef GRADSYNC_F16C
    if constexpr (std::is_same_v<S, float16>) {
        if (has_f16c()) return widen_f16c(in, out, n);
    }
#endif
    if constexpr (std::is_same_v<S, bfloat16>)
        widen_from_bfloat16(in, out, n);
    else
        for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}
template <class S>
inline void narrow_from_float(const float* in, S* out, std::size_t n) {
#ifdef GRADSYNC_F16C
    if constexpr (std::is_same_v<S, float16>) {
        if (has_f16c()) return narrow_f16c(in, out, n);
    }
#endif
    if constexpr (std::is_same_v<S, bfloat16>)
        narrow_to_bfloat16(in, out, n);
    else
        for (std::size_t i = 0; i < n; ++i) out[i] = S(in[i]);
}

}  // namespace detail

template <>
struct dtype_traits<float16> {
    static constexpr DType value = DType::float16;
};
template <>
struct dtype_traits<bfloat16> {
    static constexpr DType value = DType::bfloat16;
};

}  // namespace gradsync::inline v0
