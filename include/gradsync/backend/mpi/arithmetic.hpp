// The host arithmetic of MpiBackend: the ring's reduction step (add what was received, scaled
// for an average on the last step), the division of an average, and MPI's user-defined sum of
// the 16-bit types (widened to float, added, rounded once).
#pragma once

#include <gradsync/detail/host_reduce.hpp>
#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/half.hpp>

#include <algorithm>  // for std::min
#include <cstddef>

namespace gradsync::inline v0::detail {

template <class S>
void add_scaled_16(S* out, const S* in, float factor, std::size_t n) {
    constexpr std::size_t block = 512;
    float a[block];
    float b[block];
    for (std::size_t off = 0; off < n; off += block) {
        const std::size_t k = std::min(block, n - off);
        widen_to_float(in + off, a, k);
        widen_to_float(out + off, b, k);
        add_scaled(b, a, factor, k);
        narrow_from_float(b, out + off, k);
    }
}

// MPI's user-defined reductions for the 16-bit types: widen, add in float, round once.
template <class S>
void mpi_sum_16(void* in, void* inout, int* len, MPI_Datatype*) {
    add_scaled_16(static_cast<S*>(inout), static_cast<const S*>(in), 1.0f, static_cast<std::size_t>(*len));
}

// out[i] = (out[i] + in[i]) * factor for n elements of dtype t, as the ring's reduction step.
inline void add_received(std::byte* out, const std::byte* in, std::size_t n, DType t, double factor) {
    visit_float_dtype(t, [&]<class T>(type_tag<T>) {
        if constexpr (sizeof(T) == 2)
            add_scaled_16(reinterpret_cast<T*>(out), reinterpret_cast<const T*>(in), float(factor), n);
        else
            add_scaled(reinterpret_cast<T*>(out), reinterpret_cast<const T*>(in), T(factor), n);
    });
}

template <class S>
void scale_16(S* data, float factor, std::size_t n) {
    constexpr std::size_t block = 1024;
    float tmp[block];
    for (std::size_t off = 0; off < n; off += block) {
        const std::size_t k = std::min(block, n - off);
        widen_to_float(data + off, tmp, k);
        for (std::size_t i = 0; i < k; ++i) tmp[i] *= factor;
        narrow_from_float(tmp, data + off, k);
    }
}

// Divides n elements of dtype t by the number of ranks (an average), as a multiplication by
// 1 / ranks in the accumulator type, as every backend does.
inline void average_elements(std::byte* data, std::size_t n, DType t, int ranks) {
    visit_float_dtype(t, [&]<class T>(type_tag<T>) {
        using A = accumulator_t<T>;
        const A factor = A(1) / static_cast<A>(ranks);
        if constexpr (sizeof(T) == 2)
            scale_16(reinterpret_cast<T*>(data), factor, n);
        else
            scale_in_place(reinterpret_cast<T*>(data), factor, n);
    });
}

}  // namespace gradsync::inline v0::detail
