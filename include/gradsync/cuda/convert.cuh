// Element conversions on the device: the accumulator type of each storage type (double for
// double, float for the rest, as on the host) and the widening and round-to-nearest-even
// narrowing between them, for every kernel that reads or writes 16-bit values. Needs nvcc.
#pragma once

#include <gradsync/half.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>  // for std::conditional_t, std::is_same_v

namespace gradsync::inline v0::cuda::detail {

// The accumulator of a storage type: double for double, float for the rest, as on the host.
template <class T>
using device_accumulator_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
__device__ inline device_accumulator_t<T> widen(T v) {
    if constexpr (std::is_same_v<T, float16>)
        return __half2float(__ushort_as_half(v.bits));
    else if constexpr (std::is_same_v<T, bfloat16>)
        return __bfloat162float(__ushort_as_bfloat16(v.bits));
    else
        return v;
}

template <class T>
__device__ inline T narrow(device_accumulator_t<T> v) {
    T out{};
    if constexpr (std::is_same_v<T, float16>)
        out.bits = __half_as_ushort(__float2half_rn(v));
    else if constexpr (std::is_same_v<T, bfloat16>)
        out.bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
    else
        out = v;
    return out;
}

}  // namespace gradsync::inline v0::cuda::detail
