// Host reduction loops. Written as fixed-width inner loops over restrict pointers so that g++
// vectorizes them at -O2 as well as -O3; the sum order is always rank 0, 1, 2, ... so every
// algorithm and every rank produces bitwise identical results.
#pragma once

#include <gradsync/version.hpp>

#include <algorithm>  // for std::min
#include <cstddef>
#include <cstring>  // for std::memcpy

namespace gradsync::inline v0::detail {

inline constexpr std::size_t reduce_block_bytes = 8192;  // one block of every input fits in L1
inline constexpr std::size_t simd_width = 16;

template <class T>
inline void add_two(T* __restrict out, const T* __restrict a, const T* __restrict b, std::size_t n) {
    std::size_t i = 0;
    for (; i + simd_width <= n; i += simd_width)
        for (std::size_t j = 0; j < simd_width; ++j) out[i + j] = a[i + j] + b[i + j];
    for (; i < n; ++i) out[i] = a[i] + b[i];
}

template <class T>
inline void add_into(T* __restrict out, const T* __restrict a, std::size_t n) {
    std::size_t i = 0;
    for (; i + simd_width <= n; i += simd_width)
        for (std::size_t j = 0; j < simd_width; ++j) out[i + j] += a[i + j];
    for (; i < n; ++i) out[i] += a[i];
}

template <class T>
inline void scale_in_place(T* __restrict out, T factor, std::size_t n) {
    std::size_t i = 0;
    for (; i + simd_width <= n; i += simd_width)
        for (std::size_t j = 0; j < simd_width; ++j) out[i + j] *= factor;
    for (; i < n; ++i) out[i] *= factor;
}

// For every i < n: the sum of inputs[0..n_in)[i] in rank order, times `factor` when `scaled`,
// written to every outputs[0..n_out)[i]. Outputs may alias inputs: each block is read in full
// into `tmp` (reduce_block_bytes, aligned) before any of it is written.
template <class T>
void reduce_to_all(T* const* inputs, int n_in, T* const* outputs, int n_out, std::size_t n, bool scaled, T factor,
                   T* tmp) {
    constexpr std::size_t block = reduce_block_bytes / sizeof(T);
    for (std::size_t off = 0; off < n; off += block) {
        std::size_t k = std::min(block, n - off);
        if (n_in == 1) {
            std::memcpy(tmp, inputs[0] + off, k * sizeof(T));
        } else {
            add_two(tmp, inputs[0] + off, inputs[1] + off, k);
            for (int s = 2; s < n_in; ++s) add_into(tmp, inputs[s] + off, k);
        }
        if (scaled) scale_in_place(tmp, factor, k);
        for (int o = 0; o < n_out; ++o) std::memcpy(outputs[o] + off, tmp, k * sizeof(T));
    }
}

}  // namespace gradsync::inline v0::detail
