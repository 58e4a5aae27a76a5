// libtorch models as gradsync models, with no code from the user: any torch::nn::Module (a
// subclass, a module holder such as torch::nn::Sequential, or a std::shared_ptr to a module) can
// be wrapped in a DataParallel, and gradsync::libtorch::overlap(dp) starts each bucket's
// allreduce from torch's backward. Opt-in: needs libtorch, and is not in the umbrella header.
//
//   #include <torch/torch.h>
//   #include <gradsync/torch.hpp>
//   gradsync::DataParallel dp(*net, backend);          // or dp(net, backend) for a holder
//   auto hooks = gradsync::libtorch::overlap(dp);       // optional: overlap with backward
//
// The trainable parameters (requires_grad) are listed in named_parameters() order, the buffers
// (BatchNorm's running statistics) in named_buffers() order. A parameter without a gradient gets
// zeros, so a DataParallel can be made before the first backward; a gradient torch freed
// (zero_grad(true), libtorch 2.x's default) is left to torch's backward to make, and followed to
// its new storage.
#pragma once

#include <gradsync/version.hpp>

#include <gradsync/data_parallel.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/model/buffers.hpp>
#include <gradsync/model/model.hpp>

#include <torch/csrc/autograd/function.h>  // for Node::add_post_hook
#include <torch/csrc/autograd/variable.h>  // for impl::grad_accumulator
#include <torch/torch.h>

#include <atomic>
#include <concepts>  // for std::derived_from
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>  // for std::invoke_result_t
#include <utility>      // for std::declval, std::exchange, std::move
#include <vector>

namespace gradsync::inline v0::libtorch {

// A torch module itself (a subclass of torch::nn::Module).
template <class M>
concept Module = std::derived_from<M, ::torch::nn::Module>;

// A module holder: torch::nn::Linear, torch::nn::Sequential, TORCH_MODULE(Net)'s Net.
template <class M>
concept ModuleHolder = requires {
    typename M::ContainedType;
}
&&std::derived_from<M, ::torch::nn::ModuleHolder<typename M::ContainedType>>;

namespace detail {
template <class M>
struct is_module_pointer : std::false_type {};
template <Module M>
struct is_module_pointer<std::shared_ptr<M>> : std::true_type {};
}  // namespace detail

// Any way a trainer holds a torch model.
template <class M>
concept TorchModel = Module<M> || ModuleHolder<M> || detail::is_module_pointer<M>::value;

// The module behind any of them.
template <TorchModel M>
::torch::nn::Module& module_of(M& model) {
    if constexpr (Module<M>)
        return model;
    else
        return *model;  // a holder's operator* and a shared_ptr's alike
}

// What parameters_of() does for a parameter torch has no gradient for yet.
enum class MissingGradients {
    make_zeros,  // allocate one: the DataParallel is being made, or synchronize() reads it
    leave_null,  // report none: backward is still running and torch will make it (zero_grad(true))
};

namespace detail {

inline std::optional<DType> gradsync_dtype(::c10::ScalarType type) {
    switch (type) {
        case ::c10::ScalarType::Float: return DType::float32;
        case ::c10::ScalarType::Double: return DType::float64;
        case ::c10::ScalarType::Half: return DType::float16;
        case ::c10::ScalarType::BFloat16: return DType::bfloat16;
        case ::c10::ScalarType::Int: return DType::int32;
        case ::c10::ScalarType::Long: return DType::int64;
        default: return std::nullopt;
    }
}

inline std::string describe(const ::at::Tensor& t) {
    return std::string(::c10::toString(t.scalar_type())) + " on " + t.device().str();
}

// The checks every tensor gradsync reads through a raw pointer must pass: dense, contiguous, on
// the same device as the first. what() names the tensor, only for an error: the model is listed
// again for every bucket while backward runs.
template <class What>
void check_dense(const ::at::Tensor& t, const ::c10::Device& device, const What& what) {
    if (t.layout() != ::c10::kStrided || !t.is_contiguous())
        throw InvalidModel("gradsync: " + what() + " is not a dense contiguous tensor; gradsync reads it as one " +
                           "block of memory (call .contiguous() on it when the model is built)");
    if (t.device() != device)
        throw InvalidModel("gradsync: " + what() + " is on " + t.device().str() +
                           " but the model's first parameter is on " + device.str() +
                           "; every tensor of one rank's model must be on one device");
}

// The gradient of `param` (null where torch has none yet and `missing` is leave_null; else made,
// zeros: a parameter unused in this backward contributes nothing), checked to be usable as one
// block of param's shape.
inline void* gradient_of(::at::Tensor& param, const std::string& name, MissingGradients missing) {
    auto& grad = param.mutable_grad();
    if (!grad.defined()) {
        if (missing == MissingGradients::leave_null) return nullptr;
        ::at::NoGradGuard no_grad;
        grad = ::at::zeros_like(param, ::c10::MemoryFormat::Contiguous);
    }
    if (grad.scalar_type() != param.scalar_type() || grad.numel() != param.numel())
        throw InvalidModel("gradsync: the gradient of parameter '" + name + "' is " + describe(grad) + " of " +
                           std::to_string(grad.numel()) + " elements, but the parameter is " + describe(param) +
                           " of " + std::to_string(param.numel()));
    check_dense(grad, param.device(), [&] { return "the gradient of parameter '" + name + "'"; });
    return grad.data_ptr();
}

}  // namespace detail

// The trainable parameters of `module` (requires_grad), with their full names, in the order
// gradsync lists them: the indices grad_ready() takes.
inline std::vector<std::pair<std::string, ::at::Tensor>> trainable(::torch::nn::Module& module) {
    std::vector<std::pair<std::string, ::at::Tensor>> out;
    for (auto& item : module.named_parameters(/*recurse=*/true))
        if (item.value().requires_grad()) out.emplace_back(item.key(), item.value());
    return out;
}

// Trainable parameters (as trainable() lists them) as gradsync parameters, gradients made where
// absent unless `missing` says to leave them null.
inline std::vector<Parameter> parameters_of(std::span<std::pair<std::string, ::at::Tensor>> params,
                                            MissingGradients missing = MissingGradients::make_zeros) {
    std::vector<Parameter> out;
    out.reserve(params.size());
    for (auto& [name, param] : params) {
        const auto dtype = detail::gradsync_dtype(param.scalar_type());
        if (!dtype || *dtype == DType::int32 || *dtype == DType::int64)
            throw InvalidModel("gradsync: parameter '" + name + "' is " + detail::describe(param) +
                               "; gradsync synchronizes float32, float64, float16 and bfloat16 parameters");
        detail::check_dense(param, params.front().second.device(), [&] { return "parameter '" + name + "'"; });
        void* grad = detail::gradient_of(param, name, missing);
        const auto sizes = param.sizes();
        out.push_back(Parameter{name, param.data_ptr(), grad, static_cast<std::size_t>(param.numel()), *dtype,
                                std::vector<std::size_t>(sizes.begin(), sizes.end())});
    }
    return out;
}

// The module's trainable parameters as gradsync parameters (see above).
inline std::vector<Parameter> parameters_of(::torch::nn::Module& module,
                                            MissingGradients missing = MissingGradients::make_zeros) {
    auto params = trainable(module);
    return parameters_of(params, missing);
}

// The module's trainable parameters kept for one step, to list them again during its backward
// from the tensors themselves: named_parameters() builds every name anew, most of a listing's
// cost, and a module's parameter tensors do not change within a step (their gradients may).
class StepLister {
public:
    explicit StepLister(::torch::nn::Module& module) : params_(trainable(module)) {}
    [[nodiscard]] std::vector<Parameter> parameters_now() {
        return parameters_of(params_, MissingGradients::leave_null);
    }

private:
    std::vector<std::pair<std::string, ::at::Tensor>> params_;
};

// The module's buffers (BatchNorm's running mean and variance, its int64 batch counter).
inline std::vector<ModelBuffer> buffers_of(::torch::nn::Module& module) {
    std::vector<ModelBuffer> out;
    const auto params = module.parameters(/*recurse=*/true);
    const auto device = params.empty() ? ::c10::Device(::c10::kCPU) : params.front().device();
    for (auto& item : module.named_buffers(/*recurse=*/true)) {
        auto& buffer = item.value();
        const auto dtype = detail::gradsync_dtype(buffer.scalar_type());
        if (!dtype)
            throw InvalidModel("gradsync: buffer '" + item.key() + "' is " + detail::describe(buffer) +
                               "; gradsync keeps float, int32 and int64 buffers in step. Leave the buffers "
                               "alone with the policy gradsync::IgnoreBuffers, or make it one of those");
        detail::check_dense(buffer, device, [&] { return "buffer '" + item.key() + "'"; });
        const auto sizes = buffer.sizes();
        out.push_back(ModelBuffer{item.key(), buffer.data_ptr(), static_cast<std::size_t>(buffer.numel()), *dtype,
                                  std::vector<std::size_t>(sizes.begin(), sizes.end())});
    }
    return out;
}

// Calls f() after torch has accumulated the gradient of one parameter: a post hook of the
// parameter's AccumulateGrad node. (A tensor hook, register_hook(), runs before accumulation,
// when the gradient is not in param.grad() yet.)
template <class F>
class AfterAccumulation final : public ::torch::autograd::FunctionPostHook {
public:
    explicit AfterAccumulation(F f) : f_(std::move(f)) {}
    ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                                const ::torch::autograd::variable_list& /*inputs*/) override {
        f_();
        return outputs;
    }

private:
    F f_;
};

// The hooks overlap() registers; they are removed when this goes. Hooks that outlive their
// wrapper call nothing: a backward after it is gone only accumulates, as plain torch does.
class Overlap {
public:
    Overlap() = default;
    Overlap(Overlap&& other) noexcept
        : hooks_(std::exchange(other.hooks_, {})), reported_(std::exchange(other.reported_, nullptr)) {}
    Overlap& operator=(Overlap&& other) noexcept {
        if (this != &other) {
            remove();
            hooks_ = std::exchange(other.hooks_, {});
            reported_ = std::exchange(other.reported_, nullptr);
        }
        return *this;
    }
    ~Overlap() { remove(); }

    // Parameters hooked.
    [[nodiscard]] std::size_t size() const { return hooks_.size(); }
    // Gradients the hooks have reported ready, over all steps so far.
    [[nodiscard]] std::uint64_t reported() const { return reported_ ? reported_->load() : 0; }

    // Calls on_accumulated() each time torch has accumulated param's gradient; one that returns
    // a bool reports (and is counted) only when it returns true.
    template <class F>
    void add(const ::at::Tensor& param, F on_accumulated) {
        // Held here: autograd keeps only a weak reference to a leaf's accumulator, and a new one
        // (without the hook) would be made for the next forward if this one were freed.
        auto node = ::torch::autograd::impl::grad_accumulator(param);
        if (!node)
            throw InvalidModel(
                "gradsync: a parameter that requires a gradient has no gradient accumulator "
                "(is it a leaf tensor?)");
        auto counted = [f = std::move(on_accumulated), count = reported_.get()]() mutable {
            if constexpr (std::is_same_v<std::invoke_result_t<F&>, bool>) {
                if (!f()) return;  // nothing reported
            } else {
                f();
            }
            count->fetch_add(1, std::memory_order_relaxed);
        };
        const auto key =
            node->add_post_hook(std::make_unique<AfterAccumulation<decltype(counted)>>(std::move(counted)));
        hooks_.push_back({std::move(node), key});
    }

private:
    // std::shared_ptr in libtorch 1.x, c10::intrusive_ptr in later releases.
    using NodePointer = decltype(::torch::autograd::impl::grad_accumulator(std::declval<const ::at::Tensor&>()));
    struct Hook {
        NodePointer node;
        std::uintptr_t key;
    };
    void remove() {
        for (auto& hook : hooks_) hook.node->del_post_hook(hook.key);
        hooks_.clear();
    }
    std::vector<Hook> hooks_;
    // On the heap: the hooks hold its address, which must survive moves of this object.
    std::unique_ptr<std::atomic<std::uint64_t>> reported_ = std::make_unique<std::atomic<std::uint64_t>>(0);
};

// Registers, for every trainable parameter of dp's model, a hook that calls dp.grad_ready() once
// torch has accumulated that parameter's gradient in backward, so each bucket's allreduce starts
// while backward goes on. One backward per synchronized step (accumulate under dp.no_sync()); a
// parameter the forward did not use gets no call (Options::find_unused_parameters). Keep the
// returned object as long as the DataParallel trains; once the DataParallel is gone (its
// lifetime() expired) the hooks call nothing.
template <class DP>
[[nodiscard]] Overlap overlap(DP& dp) {
    Overlap hooks;
    const auto params = trainable(module_of(dp.model()));
    for (std::size_t i = 0; i < params.size(); ++i)
        hooks.add(params[i].second, [&dp, i, alive = dp.lifetime()] {
            if (alive.expired()) return false;
            dp.grad_ready(i);
            return true;
        });
    return hooks;
}

}  // namespace gradsync::inline v0::libtorch

namespace gradsync::inline v0 {

// Every torch model lists through the adapter; model_traits takes precedence over the module's
// own parameters() and buffers().
template <libtorch::TorchModel M>
struct model_traits<M> {
    static std::vector<Parameter> parameters(M& model) { return libtorch::parameters_of(libtorch::module_of(model)); }
    // During backward: a gradient torch has not made yet stays null (made here, it would cost a
    // pass of zeros and turn torch's adoption of the incoming gradient into an in-place sum).
    static std::vector<Parameter> parameters_now(M& model) {
        return libtorch::parameters_of(libtorch::module_of(model), libtorch::MissingGradients::leave_null);
    }
    // Within one step's backward, again for every bucket launched after the first.
    static libtorch::StepLister lister_for_step(M& model) { return libtorch::StepLister(libtorch::module_of(model)); }
    static std::vector<ModelBuffer> buffers(M& model) { return libtorch::buffers_of(libtorch::module_of(model)); }
    // ShardedDataParallel's stage 2: the gradients go back to torch's allocator (as zero_grad(true)
    // would send them); torch's next backward makes them again.
    static void release_gradients(M& model, std::span<const std::size_t> indices) {
        auto params = libtorch::trainable(libtorch::module_of(model));
        for (auto i : indices) params.at(i).second.mutable_grad() = ::at::Tensor();
    }
};

}  // namespace gradsync::inline v0
