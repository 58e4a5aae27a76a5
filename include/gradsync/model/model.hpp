// Model access: how gradsync lists a model's parameters as (name, data, gradient, count, dtype).
// The customization point gradsync::parameters(model) tries, in order, a model_traits<M>
// specialization, a member m.parameters(), and a free function parameters(m) found by ADL.
#pragma once

#include <gradsync/bytes.hpp>
#include <gradsync/detail/meta.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <concepts>  // for std::convertible_to
#include <cstddef>
#include <functional>  // for std::function
#include <memory>      // for std::make_shared
#include <ranges>      // for std::ranges::input_range, contiguous_range
#include <span>
#include <string>
#include <type_traits>  // for std::remove_cvref_t, std::is_pointer_v
#include <utility>      // for std::move
#include <vector>

namespace gradsync::inline v0 {

// One trainable tensor: its values, its gradient, both of `count` elements of `dtype`.
// gradsync reads and writes through the pointers; the buffers stay owned by the model and must
// not move while a DataParallel uses them. `shape`, optional, gives the tensor's dimensions,
// row-major (their product is `count`): a communication hook that treats a weight as a matrix
// (PowerSGD) reads it; every rank must state the same.
struct Parameter {
    std::string name;
    void* data = nullptr;
    void* grad = nullptr;
    std::size_t count = 0;
    DType dtype = DType::float32;
    std::vector<std::size_t> shape{};

    [[nodiscard]] Bytes bytes() const { return Bytes{count * size_of(dtype)}; }
};

// The elements a shape holds.
inline std::size_t shape_elements(const std::vector<std::size_t>& shape) {
    std::size_t n = 1;
    for (auto d : shape) n *= d;
    return n;
}
// "[784, 512]"
inline std::string shape_text(const std::vector<std::size_t>& shape) {
    std::string out = "[";
    for (std::size_t k = 0; k < shape.size(); ++k) out += (k ? ", " : "") + std::to_string(shape[k]);
    return out + "]";
}

// A parameter over raw pointers of an element type with a DType (float, double).
template <HasDType T>
Parameter parameter(std::string name, T* data, T* grad, std::size_t count, std::vector<std::size_t> shape = {}) {
    return Parameter{std::move(name), data, grad, count, dtype_of<T>, std::move(shape)};
}

// A parameter over two contiguous containers (std::vector, std::array, std::span) of equal size.
template <std::ranges::contiguous_range D, std::ranges::contiguous_range G>
requires std::ranges::sized_range<D> && std::ranges::sized_range<G> &&
    std::same_as<std::ranges::range_value_t<D>, std::ranges::range_value_t<G>> &&
    HasDType<std::ranges::range_value_t<D>>
        Parameter parameter(std::string name, D& data, G& grad, std::vector<std::size_t> shape = {}) {
    auto n = std::ranges::size(data);
    if (std::ranges::size(grad) != n) {
        throw InvalidModel("gradsync: parameter '" + name + "' has " + std::to_string(n) + " values but " +
                           std::to_string(std::ranges::size(grad)) +
                           " gradient elements; give both buffers the same size");
    }
    return parameter(std::move(name), std::ranges::data(data), std::ranges::data(grad), n, std::move(shape));
}

// Specialize for a model type you cannot change:
//   template <> struct gradsync::model_traits<Net> {
//       static std::vector<gradsync::Parameter> parameters(Net& net);
//       // Optional: the parameters as they are during backward, where a gradient the framework
//       // has not made yet may be null (parameters() must make it: it is read at synchronize()).
//       static std::vector<gradsync::Parameter> parameters_now(Net& net);
//       // Optional: what listing them again within one step needs, kept: an object whose
//       // parameters_now() lists as parameters_now(net) would, without what does not change in
//       // a step (a framework's parameter objects, their names). Made once per step, at the first
//       // bucket launched in backward, and asked for that bucket and every one launched after it.
//       static Lister lister_for_step(Net& net);
//   };
// (A model type of your own may have members parameters_now() and lister_for_step() instead.)
template <class Model>
struct model_traits {};

template <class R>
concept ParameterRange =
    std::ranges::input_range<R> && std::convertible_to<std::ranges::range_reference_t<R>, Parameter>;

namespace detail::parameters_cpo {

void parameters() = delete;  // hides gradsync::parameters from the ADL call below

template <class M>
concept has_traits = requires(M& m) {
    { model_traits<std::remove_cvref_t<M>>::parameters(m) } -> ParameterRange;
};
template <class M>
concept has_member = requires(M& m) {
    { m.parameters() } -> ParameterRange;
};
template <class M>
concept has_adl = requires(M& m) {
    { parameters(m) } -> ParameterRange;
};

template <class R>
std::vector<Parameter> to_vector(R&& range) {
    if constexpr (std::is_same_v<R, std::vector<Parameter>>) return std::move(range);  // a list returned by value
    std::vector<Parameter> out;
    if constexpr (std::ranges::sized_range<R>) out.reserve(std::ranges::size(range));
    for (auto&& p : range) out.push_back(static_cast<Parameter>(p));
    return out;
}

struct fn {
    template <class M>
    requires has_traits<M> || has_member<M> || has_adl<M> std::vector<Parameter>
    operator()(M& model) const {
        if constexpr (has_traits<M>) {
            return to_vector(model_traits<std::remove_cvref_t<M>>::parameters(model));
        } else if constexpr (has_member<M>) {
            return to_vector(model.parameters());
        } else {
            return to_vector(parameters(model));
        }
    }
};

}  // namespace detail::parameters_cpo

// gradsync::parameters(model): the model's parameters in registration order.
inline constexpr detail::parameters_cpo::fn parameters{};

namespace detail {

// The parameters as they are now, during backward, to follow storage that moves: the model's
// model_traits<M>::parameters_now or member parameters_now() where it has one, else
// gradsync::parameters(model).
template <class M>
std::vector<Parameter> parameters_now(M& model) {
    using traits = model_traits<std::remove_cvref_t<M>>;
    if constexpr (requires {
                      { traits::parameters_now(model) } -> ParameterRange;
                  })
        return parameters_cpo::to_vector(traits::parameters_now(model));
    else if constexpr (requires {
                           { model.parameters_now() } -> ParameterRange;
                       })
        return parameters_cpo::to_vector(model.parameters_now());
    else
        return gradsync::parameters(model);
}

// Lists the parameters again and again during one step's backward: with the lister the model
// keeps for a step (model_traits<M>::lister_for_step or member lister_for_step()) where it has
// one, else parameters_now(model) each time. Valid until the step ends.
template <class M>
std::function<std::vector<Parameter>()> lister_for_step(M& model) {
    using traits = model_traits<std::remove_cvref_t<M>>;
    auto keep = [](auto lister) {
        return [kept = std::make_shared<decltype(lister)>(std::move(lister))] {
            return parameters_cpo::to_vector(kept->parameters_now());
        };
    };
    if constexpr (requires {
                      { traits::lister_for_step(model).parameters_now() } -> ParameterRange;
                  })
        return keep(traits::lister_for_step(model));
    else if constexpr (requires {
                           { model.lister_for_step().parameters_now() } -> ParameterRange;
                       })
        return keep(model.lister_for_step());
    else {
        static_assert(
            !requires { traits::lister_for_step(model); } && !requires { model.lister_for_step(); },
            "gradsync: the model's lister_for_step() must return an object whose parameters_now() "
            "returns std::vector<gradsync::Parameter> (or a range of them)");
        return [&model] { return parameters_now(model); };
    }
}

}  // namespace detail

// A type gradsync can list the parameters of.
template <class M>
concept ModelAccess = std::invocable<const detail::parameters_cpo::fn&, M&>;

namespace detail {

// Instantiated where a model type is required: one readable error instead of a concept trace.
// After its static_assert it still answers true, so that the caller's own check adds no second
// error.
template <class M>
constexpr bool check_model_access() {
    if constexpr (std::is_pointer_v<M>) {
        static_assert(dependent_false<M>,
                      "gradsync: the model was passed by pointer; DataParallel takes the model itself: write "
                      "`gradsync::DataParallel dp(*model, backend)`");
    } else if constexpr (ModelAccess<M>) {
    } else if constexpr (requires(M & m) { m.parameters(); }) {
        static_assert(dependent_false<M>,
                      "gradsync: Model::parameters() exists but does not return a range of gradsync::Parameter. "
                      "Where it cannot change (a framework's own, such as torch::nn::Module::parameters()), "
                      "specialize gradsync::model_traits<Model> with `static std::vector<gradsync::Parameter> "
                      "parameters(Model&)`: it takes precedence over the member. See docs/adapting-models.md");
    } else {
        static_assert(dependent_false<M>,
                      "gradsync: cannot list the parameters of this model type. Provide one of: "
                      "(1) a member function `std::vector<gradsync::Parameter> parameters()`; "
                      "(2) a free function `std::vector<gradsync::Parameter> parameters(Model&)` "
                      "in the model's namespace; "
                      "(3) a specialization of `gradsync::model_traits<Model>` with "
                      "`static std::vector<gradsync::Parameter> parameters(Model&)`. "
                      "See README.md, 'Adapting a model'.");
    }
    return true;
}

}  // namespace detail

}  // namespace gradsync::inline v0
