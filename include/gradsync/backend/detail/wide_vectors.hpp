// The ring's reduction step, out = (out + in) * factor, in the widest vectors the CPU offers
// (AVX-512, AVX2, else 16 bytes), chosen once at run time: the library is compiled for the
// baseline x86-64 its users build for, but on 2 processes of an AVX-512 VM MpiBackend's step took
// 8 % of BERT-base's synchronize() more with 16-byte vectors than Open MPI's own reduction, which
// dispatches the same way. Element by element the same arithmetic as the scalar loop, so the same
// bits at every width (an add then a multiply: nothing a compiler may fuse).
#pragma once

#include <gradsync/backend/detail/host_reduce.hpp>
#include <gradsync/version.hpp>

#include <cstddef>
#include <cstring>  // for std::memcpy

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && \
    !defined(__NVCOMPILER)
#define GRADSYNC_WIDE_VECTORS 1
#endif

namespace gradsync::inline v0::detail {

enum class VectorWidth : unsigned char { bytes16 = 16, bytes32 = 32, bytes64 = 64 };

// The widest the CPU running this offers.
inline VectorWidth widest_vector_width() {
#ifdef GRADSYNC_WIDE_VECTORS
    static const VectorWidth widest = [] {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f")) return VectorWidth::bytes64;
        if (__builtin_cpu_supports("avx2")) return VectorWidth::bytes32;
        return VectorWidth::bytes16;
    }();
    return widest;
#else
    return VectorWidth::bytes16;
#endif
}

// The loop at one width: V is a GCC vector of T. Inlined into a function compiled for V's
// instruction set.
template <class V, class T>
[[gnu::always_inline]] inline void add_scaled_as(T* __restrict out, const T* __restrict in, T factor, std::size_t n) {
    constexpr std::size_t lanes = sizeof(V) / sizeof(T);
    std::size_t i = 0;
    if (factor == T(1)) {
        for (; i + lanes <= n; i += lanes) {
            V a, b;
            std::memcpy(&a, out + i, sizeof a);
            std::memcpy(&b, in + i, sizeof b);
            a = a + b;
            std::memcpy(out + i, &a, sizeof a);
        }
        for (; i < n; ++i) out[i] = out[i] + in[i];
        return;
    }
    for (; i + lanes <= n; i += lanes) {
        V a, b;
        std::memcpy(&a, out + i, sizeof a);
        std::memcpy(&b, in + i, sizeof b);
        a = (a + b) * factor;
        std::memcpy(out + i, &a, sizeof a);
    }
    for (; i < n; ++i) out[i] = (out[i] + in[i]) * factor;
}

#ifdef GRADSYNC_WIDE_VECTORS
template <class T, std::size_t Bytes>
struct WideVector;
template <>
struct WideVector<float, 64> {
    using type = float __attribute__((vector_size(64)));
};
template <>
struct WideVector<double, 64> {
    using type = double __attribute__((vector_size(64)));
};
template <>
struct WideVector<float, 32> {
    using type = float __attribute__((vector_size(32)));
};
template <>
struct WideVector<double, 32> {
    using type = double __attribute__((vector_size(32)));
};

template <class T>
[[gnu::target("avx512f")]] inline void add_scaled_64(T* __restrict out, const T* __restrict in, T factor,
                                                     std::size_t n) {
    add_scaled_as<typename WideVector<T, 64>::type>(out, in, factor, n);
}
template <class T>
[[gnu::target("avx2")]] inline void add_scaled_32(T* __restrict out, const T* __restrict in, T factor, std::size_t n) {
    add_scaled_as<typename WideVector<T, 32>::type>(out, in, factor, n);
}
#endif

// out[i] = (out[i] + in[i]) * factor for float or double, at the given width (one the CPU has).
template <class T>
void add_scaled_at(VectorWidth width, T* __restrict out, const T* __restrict in, T factor, std::size_t n) {
#ifdef GRADSYNC_WIDE_VECTORS
    if (width == VectorWidth::bytes64) return add_scaled_64(out, in, factor, n);
    if (width == VectorWidth::bytes32) return add_scaled_32(out, in, factor, n);
#else
    (void)width;
#endif
    add_scaled_as<vector_of<T>>(out, in, factor, n);
}

// out[i] = (out[i] + in[i]) * factor at the widest width the CPU has; factor 1 multiplies nothing.
template <class T>
void add_scaled(T* __restrict out, const T* __restrict in, T factor, std::size_t n) {
    add_scaled_at(widest_vector_width(), out, in, factor, n);
}

}  // namespace gradsync::inline v0::detail
