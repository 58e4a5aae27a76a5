// Eigen dense objects as gradsync parameters: gradsync::parameter(name, value, grad) for
// matrices, vectors and arrays (Eigen::Matrix, Eigen::Array) and maps over memory of your own
// (Eigen::Map), of float or double. Opt-in: needs Eigen 3.3 or newer, and is not in the umbrella
// header.
//
//   Eigen::MatrixXf w, gw;
//   std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, gw)}; }
//
// gradsync reads the values and gradient as one block each, so both must lie contiguously: a
// block or a strided map is refused, naming the parameter. A matrix must not be resized while a
// DataParallel uses it. Each parameter states the shape of its memory read row-major (a
// column-major matrix's is [cols, rows]): checkpoints save it (tests/test_checkpoint_shapes.cpp
// covers stated shapes; no test runs PowerSGD over Eigen parameters).
#pragma once

#include <gradsync/version.hpp>

#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/model/model.hpp>

#include <Eigen/Core>

#include <concepts>  // for std::derived_from
#include <cstddef>
#include <string>
#include <type_traits>  // for std::remove_cvref_t, std::is_const_v
#include <utility>      // for std::move
#include <vector>

namespace gradsync::inline v0 {

namespace eigen_detail {

// A dense Eigen object that can be written through: a matrix, array or map, not a const one.
template <class T>
concept Writable = std::derived_from<std::remove_cvref_t<T>, Eigen::DenseBase<std::remove_cvref_t<T>>> &&
                   !std::is_const_v<std::remove_reference_t<T>> &&
                   requires(T & t) {
    { t.data() } -> std::same_as<typename std::remove_cvref_t<T>::Scalar*>;
};

template <class T>
bool contiguous(const T& t) {
    if (t.size() == 0) return true;
    if (t.innerStride() != 1) return false;
    return t.outerSize() == 1 || t.outerStride() == t.innerSize();
}

// The shape of t's memory read row-major, as a checkpoint saves it: a vector's length; a
// row-major matrix's rows and columns; a column-major matrix's columns and rows (its memory is
// its transpose, row-major).
template <class T>
std::vector<std::size_t> memory_shape(const T& t) {
    const auto rows = static_cast<std::size_t>(t.rows()), cols = static_cast<std::size_t>(t.cols());
    if (rows == 1 || cols == 1) return {rows * cols};
    if (std::remove_cvref_t<T>::IsRowMajor) return {rows, cols};
    return {cols, rows};
}

}  // namespace eigen_detail

// A parameter over an Eigen matrix, array or map of values and one of gradients, of the same
// scalar type and the same number of elements, each contiguous in memory.
template <class V, class G>
requires eigen_detail::Writable<V> && eigen_detail::Writable<G> &&
    std::same_as < typename std::remove_cvref_t<V>::Scalar,
typename std::remove_cvref_t<G>::Scalar >
    &&HasDType<typename std::remove_cvref_t<V>::Scalar> Parameter parameter(std::string name, V&& value, G&& grad) {
    if (value.size() != grad.size())
        throw InvalidModel("gradsync: parameter '" + name + "' has " + std::to_string(value.size()) + " values but " +
                           std::to_string(grad.size()) +
                           " gradient elements; give both the same size (resize the gradient when the model is built)");
    if (!eigen_detail::contiguous(value) || !eigen_detail::contiguous(grad))
        throw InvalidModel("gradsync: parameter '" + name + "': its " +
                           (eigen_detail::contiguous(value) ? "gradient" : "values") +
                           " do not lie contiguously in memory (a block or a strided map); gradsync reads each as "
                           "one block: pass the whole matrix, or a map over contiguous memory");
    return parameter(std::move(name), value.data(), grad.data(), static_cast<std::size_t>(value.size()),
                     eigen_detail::memory_shape(value));
}

}  // namespace gradsync::inline v0
