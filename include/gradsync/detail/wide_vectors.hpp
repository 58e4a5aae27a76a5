// Host loops in the widest vectors the CPU offers (AVX-512, AVX2, else 16 bytes), chosen once at
// run time: the library is compiled for the baseline x86-64 its users build for, and on the
// AVX-512 development VMs 16-byte vectors left 8-11 % of an allreduce's time on the table
// (LocalBackend's in-place reduction of ResNet-50's gradients, MpiBackend's ring step against
// Open MPI's own reduction, which dispatches the same way). The loops are written with GCC / Clang
// vectors rather than left to the loop vectorizer: at -O3 it rewrote plain loops into a form that
// ran MpiBackend's ring step at half the speed of -O2. Element by element every width computes the
// same arithmetic, so the same bits.
#pragma once

#include <gradsync/version.hpp>

#include <cstddef>
#include <type_traits>  // for std::is_void_v

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

// A vector of T of `Bytes` bytes; void where T has none (the loops then run element by element).
// Kernels keep them in local variables: a function that takes or returns one of 32 or 64 bytes
// has a different ABI with and without the instruction set.
template <class T, std::size_t Bytes>
struct VectorOf {
    using type = void;
};
template <>
struct VectorOf<float, 16> {
    using type = float __attribute__((vector_size(16)));
};
template <>
struct VectorOf<double, 16> {
    using type = double __attribute__((vector_size(16)));
};
template <>
struct VectorOf<float, 32> {
    using type = float __attribute__((vector_size(32)));
};
template <>
struct VectorOf<double, 32> {
    using type = double __attribute__((vector_size(32)));
};
template <>
struct VectorOf<float, 64> {
    using type = float __attribute__((vector_size(64)));
};
template <>
struct VectorOf<double, 64> {
    using type = double __attribute__((vector_size(64)));
};

// Kernel::run<V>(args...) with V of each width, inlined (run is always_inline) into a function
// compiled for that width's instruction set.
#ifdef GRADSYNC_WIDE_VECTORS
template <class Kernel, class T, class... Args>
[[gnu::target("avx512f")]] inline void run_at_64(Args... args) {
    Kernel::template run<typename VectorOf<T, 64>::type>(args...);
}
template <class Kernel, class T, class... Args>
[[gnu::target("avx2")]] inline void run_at_32(Args... args) {
    Kernel::template run<typename VectorOf<T, 32>::type>(args...);
}
#endif

// Kernel::run<V>(args...) at the given width (one the CPU has) for elements of type T.
template <class Kernel, class T, class... Args>
inline void run_at(VectorWidth width, Args... args) {
    if constexpr (std::is_void_v<typename VectorOf<T, 16>::type>) return Kernel::template run<void>(args...);
#ifdef GRADSYNC_WIDE_VECTORS
    if (width == VectorWidth::bytes64) return run_at_64<Kernel, T>(args...);
    if (width == VectorWidth::bytes32) return run_at_32<Kernel, T>(args...);
#else
    (void)width;
#endif
    Kernel::template run<typename VectorOf<T, 16>::type>(args...);
}

template <class Kernel, class T, class... Args>
inline void run_widest(Args... args) {
    run_at<Kernel, T>(widest_vector_width(), args...);
}

}  // namespace gradsync::inline v0::detail
