// The one dtype visitor: turns a floating-point DType known at run time into its C++ type, for
// code written once as a template over the element type.
#pragma once

#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

namespace gradsync::inline v0::detail {

template <class T>
struct type_tag {
    using type = T;
};

// Calls f(type_tag<T>{}) with the C++ type of a floating-point dtype.
template <class F>
void visit_float_dtype(DType t, F&& f) {
    switch (t) {
        case DType::float32: return f(type_tag<float>{});
        case DType::float64: return f(type_tag<double>{});
        case DType::float16: return f(type_tag<float16>{});
        case DType::bfloat16: return f(type_tag<bfloat16>{});
        default: throw Error("gradsync: internal error: " + to_string(t) + " is no floating-point dtype");
    }
}

}  // namespace gradsync::inline v0::detail
