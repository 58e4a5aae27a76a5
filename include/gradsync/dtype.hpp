// DType: the element type of a parameter or gradient buffer, known at run time, because one
// model may hold tensors of several types and the backends (NCCL, MPI) take types at run time.
#pragma once

#include <gradsync/version.hpp>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <type_traits>  // for std::remove_cv_t

namespace gradsync::inline v0 {

enum class DType : std::uint8_t {
    float32 = 0,
    float64 = 1,
    float16 = 2,   // IEEE binary16; no host arithmetic type yet
    bfloat16 = 3,  // no host arithmetic type yet
    int32 = 4,     // model buffers only (counters); never reduced
    int64 = 5,
};

// False for a value outside the enumeration (a corrupt or uninitialised dtype).
constexpr bool is_known(DType t) { return static_cast<std::uint8_t>(t) <= 5; }

// Element size in bytes; 0 for an unknown dtype.
constexpr std::size_t size_of(DType t) {
    switch (t) {
        case DType::float32: return 4;
        case DType::float64: return 8;
        case DType::float16:
        case DType::bfloat16: return 2;
        case DType::int32: return 4;
        case DType::int64: return 8;
    }
    return 0;
}

inline std::string to_string(DType t) {
    switch (t) {
        case DType::float32: return "float32";
        case DType::float64: return "float64";
        case DType::float16: return "float16";
        case DType::bfloat16: return "bfloat16";
        case DType::int32: return "int32";
        case DType::int64: return "int64";
    }
    return "dtype(" + std::to_string(static_cast<unsigned>(t)) + ")";
}

inline std::ostream& operator<<(std::ostream& os, DType t) { return os << to_string(t); }

// dtype_of<T>: the DType of a C++ element type; ill-formed for types without one.
template <class T>
struct dtype_traits;  // undefined: no DType for T
template <>
struct dtype_traits<float> {
    static constexpr DType value = DType::float32;
};
template <>
struct dtype_traits<double> {
    static constexpr DType value = DType::float64;
};
template <>
struct dtype_traits<std::int32_t> {
    static constexpr DType value = DType::int32;
};
template <>
struct dtype_traits<std::int64_t> {
    static constexpr DType value = DType::int64;
};

template <class T>
concept HasDType = requires {
    dtype_traits<std::remove_cv_t<T>>::value;
};

template <HasDType T>
inline constexpr DType dtype_of = dtype_traits<std::remove_cv_t<T>>::value;

}  // namespace gradsync::inline v0
