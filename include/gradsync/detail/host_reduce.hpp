// Host reduction loops, in the widest vectors the CPU has (wide_vectors.hpp);
// the sum order is always rank 0, 1, 2, ... so every algorithm and every rank produces bitwise
// identical results. Also the streaming copy, for large results nobody reads before they land.
#pragma once

#include <gradsync/detail/wide_vectors.hpp>
#include <gradsync/half.hpp>
#include <gradsync/version.hpp>

#if (defined(__SSE2__) || defined(_M_X64))
#include <emmintrin.h>  // for the streaming stores
#endif

#include <algorithm>  // for std::min
#include <cstddef>
#include <cstdint>      // for std::uintptr_t
#include <cstring>      // for std::memcpy
#include <type_traits>  // for std::is_same_v

namespace gradsync::inline v0::detail {

inline constexpr std::size_t reduce_block_bytes = 8192;  // one block of every input fits in L1
inline constexpr std::size_t simd_width = 16;

// Copies into memory that is not read before it is overwritten and far larger than the cache:
// stores that bypass the cache (non-temporal), so that no line is fetched only to be overwritten.
// LocalBackend's all_gather of 64 MiB takes two thirds of memcpy's time with them on the
// development VMs. Not for memory just read (the in-place reduction: 1.7 times slower with them),
// not under ThreadSanitizer (which does not see them), and a plain memcpy without SSE2. Followed
// by streaming_fence().
#if defined(__SANITIZE_THREAD__)
#define GRADSYNC_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GRADSYNC_THREAD_SANITIZER 1
#endif
#endif
#if (defined(__SSE2__) || defined(_M_X64)) && !defined(GRADSYNC_THREAD_SANITIZER)
#define GRADSYNC_STREAMING_STORES 1
#endif
// From 32 MiB of data across a group's buffers (a server's last-level cache): below it the next
// collective often finds the data still in cache, and streamed stores had evicted it (a 1 MiB
// reduce_scatter + all_gather took 5 times the allreduce with them, 1.3 times without; 8 MiB on
// each of 2 ranks 1.3 times the allreduce with them, 1.2 without); from it nothing stays cached
// anyway, and a plain store first reads the line it writes (16 MiB on each of 2 ranks: the
// all_gather took 3 times as long with plain stores).
inline constexpr std::size_t streaming_min_bytes = std::size_t{32} << 20;

inline void copy_streaming(void* __restrict out, const void* __restrict in, std::size_t n) {
    auto* o = static_cast<unsigned char*>(out);
    const auto* i = static_cast<const unsigned char*>(in);
    std::size_t k = 0;
#ifdef GRADSYNC_STREAMING_STORES
    const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(o) % 16) % 16;
    if (n >= head + 64) {
        std::memcpy(o, i, head);
        for (k = head; k + 64 <= n; k += 64) {
            const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(i + k));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(i + k + 16));
            const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(i + k + 32));
            const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(i + k + 48));
            _mm_stream_si128(reinterpret_cast<__m128i*>(o + k), a);
            _mm_stream_si128(reinterpret_cast<__m128i*>(o + k + 16), b);
            _mm_stream_si128(reinterpret_cast<__m128i*>(o + k + 32), c);
            _mm_stream_si128(reinterpret_cast<__m128i*>(o + k + 48), d);
        }
    }
#endif
    std::memcpy(o + k, i + k, n - k);
}

// Orders the streaming stores before what follows (the round that tells peers the data is there).
inline void streaming_fence() {
#ifdef GRADSYNC_STREAMING_STORES
    _mm_sfence();
#endif
}

// The loops, each a kernel for run_widest: whole vectors V while they fit (none where V is
// void), then element by element.
template <class V, class T>
inline constexpr std::size_t lanes = std::is_void_v<V> ? std::size_t{1} << 62 : sizeof(V) / sizeof(T);

struct AddTwo {
    template <class V, class T>
    [[gnu::always_inline]] static void run(T* __restrict out, const T* __restrict a, const T* __restrict b,
                                           std::size_t n) {
        std::size_t i = 0;
        if constexpr (!std::is_void_v<V>)
            for (V x, y; i + lanes<V, T> <= n; i += lanes<V, T>) {
                std::memcpy(&x, a + i, sizeof x);
                std::memcpy(&y, b + i, sizeof y);
                x = x + y;
                std::memcpy(out + i, &x, sizeof x);
            }
        for (; i < n; ++i) out[i] = a[i] + b[i];
    }
};
struct AddInto {
    template <class V, class T>
    [[gnu::always_inline]] static void run(T* __restrict out, const T* __restrict a, std::size_t n) {
        std::size_t i = 0;
        if constexpr (!std::is_void_v<V>)
            for (V x, y; i + lanes<V, T> <= n; i += lanes<V, T>) {
                std::memcpy(&x, out + i, sizeof x);
                std::memcpy(&y, a + i, sizeof y);
                x = x + y;
                std::memcpy(out + i, &x, sizeof x);
            }
        for (; i < n; ++i) out[i] += a[i];
    }
};
struct ScaleInPlace {
    template <class V, class T>
    [[gnu::always_inline]] static void run(T* __restrict out, T factor, std::size_t n) {
        std::size_t i = 0;
        if constexpr (!std::is_void_v<V>)
            for (V x; i + lanes<V, T> <= n; i += lanes<V, T>) {
                std::memcpy(&x, out + i, sizeof x);
                x = x * factor;
                std::memcpy(out + i, &x, sizeof x);
            }
        for (; i < n; ++i) out[i] *= factor;
    }
};
// (out + in) * factor rounds exactly as a sum followed by a separate scaling pass would, and is
// an add then a multiply: nothing a compiler may fuse into one rounding.
struct AddScaled {
    template <class V, class T>
    [[gnu::always_inline]] static void run(T* __restrict out, const T* __restrict in, T factor, std::size_t n) {
        std::size_t i = 0;
        if constexpr (!std::is_void_v<V>)
            for (V x, y; i + lanes<V, T> <= n; i += lanes<V, T>) {
                std::memcpy(&x, out + i, sizeof x);
                std::memcpy(&y, in + i, sizeof y);
                x = (x + y) * factor;
                std::memcpy(out + i, &x, sizeof x);
            }
        for (; i < n; ++i) out[i] = (out[i] + in[i]) * factor;
    }
};

// a[i] + b[i], times `factor` when `scaled`, written to first[i] and, when `Both`, second[i];
// each output is one of the inputs, element for element, so no __restrict.
template <bool Both>
struct SumPairInPlace {
    template <class V, class T>
    [[gnu::always_inline]] static void run(const T* a, const T* b, T* first, T* second, bool scaled, T factor,
                                           std::size_t n) {
        std::size_t i = 0;
        if constexpr (!std::is_void_v<V>)
            for (V x, y; i + lanes<V, T> <= n; i += lanes<V, T>) {
                std::memcpy(&x, a + i, sizeof x);
                std::memcpy(&y, b + i, sizeof y);
                x = x + y;
                if (scaled) x = x * factor;
                std::memcpy(first + i, &x, sizeof x);
                if constexpr (Both) std::memcpy(second + i, &x, sizeof x);
            }
        for (; i < n; ++i) {
            T x = a[i] + b[i];
            if (scaled) x = x * factor;
            first[i] = x;
            if constexpr (Both) second[i] = x;
        }
    }
};

// out[i] = a[i] + b[i]
template <class T>
inline void add_two(T* __restrict out, const T* __restrict a, const T* __restrict b, std::size_t n) {
    run_widest<AddTwo, T>(out, a, b, n);
}

// out[i] += a[i]
template <class T>
inline void add_into(T* __restrict out, const T* __restrict a, std::size_t n) {
    run_widest<AddInto, T>(out, a, n);
}

// out[i] *= factor
template <class T>
inline void scale_in_place(T* __restrict out, T factor, std::size_t n) {
    run_widest<ScaleInPlace, T>(out, factor, n);
}

// out[i] = (out[i] + in[i]) * factor; factor 1 multiplies nothing.
template <class T>
inline void add_scaled(T* __restrict out, const T* __restrict in, T factor, std::size_t n) {
    if (factor == T(1))
        add_into(out, in, n);
    else
        run_widest<AddScaled, T>(out, in, factor, n);
}

// What a storage type is summed in: itself, or float for the 16-bit types.
template <class S>
struct accumulator {
    using type = S;
};
template <>
struct accumulator<float16> {
    using type = float;
};
template <>
struct accumulator<bfloat16> {
    using type = float;
};
template <class S>
using accumulator_t = typename accumulator<S>::type;

// Two ranks reducing in place (each output one of the two inputs): one pass over the memory, where
// the general path writes a block of scratch and copies it out. On 2 ranks, in cache, the two
// alternating call by call in one process: 1.3 to 1.7 times faster (docs/performance.md, in cache).
template <class S>
bool sum_pair_in_place(S* const* inputs, int n_in, S* const* outputs, int n_out, std::size_t n, bool scaled, S factor) {
    const auto is_input = [&](const S* p) { return p == inputs[0] || p == inputs[1]; };
    if (n_in != 2 || n_out < 1 || n_out > 2 || !is_input(outputs[0]) || (n_out == 2 && !is_input(outputs[1])))
        return false;
    if (n_out == 2)
        run_widest<SumPairInPlace<true>, S>(inputs[0], inputs[1], outputs[0], outputs[1], scaled, factor, n);
    else
        run_widest<SumPairInPlace<false>, S>(inputs[0], inputs[1], outputs[0], outputs[0], scaled, factor, n);
    return true;
}

// For every i < n: the sum of inputs[0..n_in)[i] in rank order, in the accumulator type, times
// `factor` when `scaled`, written to every outputs[0..n_out)[i]. Outputs may alias inputs: each
// block is read in full into `scratch` (reduce_block_bytes, aligned) before any of it is written.
template <class S>
void reduce_to_all(S* const* inputs, int n_in, S* const* outputs, int n_out, std::size_t n, bool scaled,
                   accumulator_t<S> factor, void* scratch) {
    using A = accumulator_t<S>;
    if constexpr (std::is_same_v<S, A>) {
        if (sum_pair_in_place(inputs, n_in, outputs, n_out, n, scaled, factor)) return;
        constexpr std::size_t block = reduce_block_bytes / sizeof(S);
        auto* tmp = static_cast<S*>(scratch);
        for (std::size_t off = 0; off < n; off += block) {
            std::size_t k = std::min(block, n - off);
            if (n_in == 1) {
                std::memcpy(tmp, inputs[0] + off, k * sizeof(S));
            } else {
                add_two(tmp, inputs[0] + off, inputs[1] + off, k);
                for (int s = 2; s < n_in; ++s) add_into(tmp, inputs[s] + off, k);
            }
            if (scaled) scale_in_place(tmp, factor, k);
            for (int o = 0; o < n_out; ++o) std::memcpy(outputs[o] + off, tmp, k * sizeof(S));
        }
    } else {
        // Widen into A, sum there, narrow once (rounding to nearest even), copy to every output.
        constexpr std::size_t block = reduce_block_bytes / (2 * sizeof(A) + sizeof(S)) / simd_width * simd_width;
        auto* acc = static_cast<A*>(scratch);
        auto* wide = acc + block;
        auto* narrowed = reinterpret_cast<S*>(wide + block);
        for (std::size_t off = 0; off < n; off += block) {
            std::size_t k = std::min(block, n - off);
            widen_to_float(inputs[0] + off, acc, k);
            for (int s = 1; s < n_in; ++s) {
                widen_to_float(inputs[s] + off, wide, k);
                add_into(acc, wide, k);
            }
            if (scaled) scale_in_place(acc, factor, k);
            narrow_from_float(acc, narrowed, k);
            for (int o = 0; o < n_out; ++o) std::memcpy(outputs[o] + off, narrowed, k * sizeof(S));
        }
    }
}

}  // namespace gradsync::inline v0::detail
