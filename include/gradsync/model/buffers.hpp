// Model buffers: non-parameter state such as batch-norm running statistics, listed through the
// customization point gradsync::buffers(model), and the policies that keep them in step.
#pragma once

#include <gradsync/bytes.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/model/model.hpp>  // for model_traits

#include <concepts>  // for std::convertible_to
#include <cstddef>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>  // for std::remove_cvref_t
#include <utility>      // for std::move
#include <vector>

namespace gradsync::inline v0 {

// One state tensor of `count` elements of `dtype`; buffers have no gradient.
struct ModelBuffer {
    std::string name;
    void* data = nullptr;
    std::size_t count = 0;
    DType dtype = DType::float32;
    std::vector<std::size_t> shape{};  // optional, as a Parameter's: a checkpoint saves it

    [[nodiscard]] Bytes bytes() const { return Bytes{count * size_of(dtype)}; }
};

template <class T>
requires std::ranges::contiguous_range<T> && std::ranges::sized_range<T> && HasDType<std::ranges::range_value_t<T>>
    ModelBuffer model_buffer(std::string name, T& data, std::vector<std::size_t> shape = {}) {
    return ModelBuffer{std::move(name), std::ranges::data(data), std::ranges::size(data),
                       dtype_of<std::ranges::range_value_t<T>>, std::move(shape)};
}

template <class R>
concept ModelBufferRange =
    std::ranges::input_range<R> && std::convertible_to<std::ranges::range_reference_t<R>, ModelBuffer>;

namespace detail::buffers_cpo {

void buffers() = delete;  // hides gradsync::buffers from the ADL call below

template <class M>
concept has_traits = requires(M& m) {
    { model_traits<std::remove_cvref_t<M>>::buffers(m) } -> ModelBufferRange;
};
template <class M>
concept has_member = requires(M& m) {
    { m.buffers() } -> ModelBufferRange;
};
template <class M>
concept has_adl = requires(M& m) {
    { buffers(m) } -> ModelBufferRange;
};

template <class R>
std::vector<ModelBuffer> to_vector(R&& range) {
    std::vector<ModelBuffer> out;
    for (auto&& b : range) out.push_back(static_cast<ModelBuffer>(b));
    return out;
}

struct fn {
    // Same order as gradsync::parameters; a model without buffers has none.
    template <class M>
    std::vector<ModelBuffer> operator()(M& model) const {
        if constexpr (has_traits<M>) {
            return to_vector(model_traits<std::remove_cvref_t<M>>::buffers(model));
        } else if constexpr (has_member<M>) {
            return to_vector(model.buffers());
        } else if constexpr (has_adl<M>) {
            return to_vector(buffers(model));
        } else {
            return {};
        }
    }
};

}  // namespace detail::buffers_cpo

// gradsync::buffers(model): the model's buffers, or none when it lists none.
inline constexpr detail::buffers_cpo::fn buffers{};

// Buffer policies: what DataParallel does with the model's buffers.
enum class BufferSync : unsigned char { broadcast_every_step, broadcast_once, average_every_step, ignore };

// Rank 0's buffers are copied to every rank at construction and at the end of every synchronize()
// (PyTorch DDP's broadcast_buffers=True). The default.
struct BroadcastBuffers {
    using policy_category = policy_category::buffers;
    [[nodiscard]] std::string settings() const { return "broadcast every step"; }
    static constexpr BufferSync mode = BufferSync::broadcast_every_step;
};
// Copied from rank 0 at construction only.
struct BroadcastBuffersOnce {
    using policy_category = policy_category::buffers;
    [[nodiscard]] std::string settings() const { return "broadcast once"; }
    static constexpr BufferSync mode = BufferSync::broadcast_once;
};
// Copied from rank 0 at construction; averaged over the ranks at the end of every synchronize()
// (buffers of a dtype the backend cannot reduce are copied from rank 0 instead).
struct AverageBuffers {
    using policy_category = policy_category::buffers;
    [[nodiscard]] std::string settings() const { return "averaged every step"; }
    static constexpr BufferSync mode = BufferSync::average_every_step;
};
// Left alone: each rank keeps its own.
struct IgnoreBuffers {
    using policy_category = policy_category::buffers;
    [[nodiscard]] std::string settings() const { return "ignored"; }
    static constexpr BufferSync mode = BufferSync::ignore;
};

namespace detail {

template <class P>
constexpr bool check_buffer_policy() {
    static_assert(
        requires {
            { P::mode } -> std::convertible_to<BufferSync>;
        },
        "gradsync: a buffer policy needs `static constexpr gradsync::BufferSync mode`");
    return true;
}

}  // namespace detail

}  // namespace gradsync::inline v0
