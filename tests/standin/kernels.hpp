// How a translation unit compiled by nvcc tells the stand-in CUDA runtime what a kernel does on
// the host: standin::on_kernel(&kernel<T>, "kernel<T>", reference), where reference(grid, block,
// args...) takes copies of the launch's arguments and runs when the stream reaches the launch.
// Kernels are matched by their device name, so a template kernel instantiated in several
// translation units (each with a host stub of its own) needs registering once.
#pragma once

#include "standin.hpp"

#include <cstddef>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace standin {

namespace detail {

template <class... Args, std::size_t... I>
std::tuple<std::decay_t<Args>...> copy_arguments(void** args, std::index_sequence<I...>) {
    return std::tuple<std::decay_t<Args>...>{*static_cast<std::decay_t<Args>*>(args[I])...};
}

}  // namespace detail

template <class... Args, class Reference>
void on_kernel(void (*kernel)(Args...), std::string name, Reference reference) {
    register_kernel(reinterpret_cast<const void*>(kernel), std::move(name),
                    [reference](void** args) -> std::function<void(dim3, dim3)> {
                        auto values = detail::copy_arguments<Args...>(args, std::index_sequence_for<Args...>{});
                        return [reference, values](dim3 grid, dim3 block) {
                            std::apply([&](const auto&... a) { reference(grid, block, a...); }, values);
                        };
                    });
}

}  // namespace standin
