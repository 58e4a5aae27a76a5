// Gradient release: how ShardedDataParallel's stage 2 tells a model that it no longer needs some
// of its gradients, so that their memory can go back before the step ends. The customization
// point gradsync::release_gradients(model, indices) tries, in order, a model_traits<M>
// specialization, a member m.release_gradients(indices), and a free function found by ADL. The
// indices are positions in the model's parameters(). A model that releases a gradient makes it
// again in its next backward (zeros, then the sum) and lists where it is then: parameters() must
// give every gradient, made where absent; model_traits<M>::parameters_now may leave it null.
// With device memory (CudaMemory) the reads of the gradients are queued on the stream when the
// model is told: it frees them in that stream's order (cudaFreeAsync on it, say).
#pragma once

#include <gradsync/model/model.hpp>

#include <concepts>  // for std::invocable
#include <cstddef>
#include <span>
#include <type_traits>  // for std::remove_cvref_t

namespace gradsync::inline v0 {

namespace detail::release_gradients_cpo {

void release_gradients() = delete;  // hides gradsync::release_gradients from the ADL call below

template <class M>
concept has_traits = requires(M& m, std::span<const std::size_t> indices) {
    model_traits<std::remove_cvref_t<M>>::release_gradients(m, indices);
};
template <class M>
concept has_member = requires(M& m, std::span<const std::size_t> indices) {
    m.release_gradients(indices);
};
template <class M>
concept has_adl = requires(M& m, std::span<const std::size_t> indices) {
    release_gradients(m, indices);
};

struct fn {
    template <class M>
    requires has_traits<M> || has_member<M> || has_adl<M>
    void operator()(M& model, std::span<const std::size_t> indices) const {
        if constexpr (has_traits<M>)
            model_traits<std::remove_cvref_t<M>>::release_gradients(model, indices);
        else if constexpr (has_member<M>)
            model.release_gradients(indices);
        else
            release_gradients(model, indices);
    }
};

}  // namespace detail::release_gradients_cpo

// gradsync::release_gradients(model, indices): the model may free the gradients of these parameters.
inline constexpr detail::release_gradients_cpo::fn release_gradients{};

// A model that can release gradients (ShardedOptions::release_gradients needs one).
template <class M>
concept ReleasableGradients =
    std::invocable<const detail::release_gradients_cpo::fn&, M&, std::span<const std::size_t>>;

}  // namespace gradsync::inline v0
