// The ways a model tells gradsync its parameters, each in a few lines; README.md quotes the
// regions between the [name] markers. Run it to see each model's bucket plan.
#include <gradsync/gradsync.hpp>

#include <array>
#include <concepts>  // for std::derived_from
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>  // for std::pair
#include <vector>

// [struct-of-vectors]
// A model you own: weights and gradients in std::vector<float>. Add a member parameters().
struct Net {
    std::vector<float> w1, b1, w2, b2;      // values
    std::vector<float> gw1, gb1, gw2, gb2;  // gradients

    std::vector<gradsync::Parameter> parameters() {
        return {gradsync::parameter("fc1.weight", w1, gw1), gradsync::parameter("fc1.bias", b1, gb1),
                gradsync::parameter("fc2.weight", w2, gw2), gradsync::parameter("fc2.bias", b2, gb2)};
    }
};
// [/struct-of-vectors]

// [llmc-blob]
// llm.c's GPT-2: every parameter in one blob, every gradient in another, and a table of sizes.
constexpr int num_parameter_tensors = 16;
struct GPT2 {
    float* params_memory;
    float* grads_memory;
    std::size_t param_sizes[num_parameter_tensors];
};

constexpr std::string_view gpt2_names[num_parameter_tensors] = {"wte",      "wpe",      "ln1w", "ln1b", "qkvw", "qkvb",
                                                                "attprojw", "attprojb", "ln2w", "ln2b", "fcw",  "fcb",
                                                                "fcprojw",  "fcprojb",  "lnfw", "lnfb"};

// A free function in the model's namespace, found by ADL; no change to the struct itself.
std::vector<gradsync::Parameter> parameters(GPT2& model) {
    return gradsync::ContiguousParameters<float>(model.params_memory, model.grads_memory, model.param_sizes, gpt2_names)
        .parameters();
}
// [/llmc-blob]

// [model-traits]
// A type you cannot touch, not even its namespace: specialize gradsync::model_traits.
struct Frozen {
    std::array<double, 8> weight{}, grad{};
};
template <>
struct gradsync::model_traits<Frozen> {
    static std::vector<gradsync::Parameter> parameters(Frozen& f) {
        return {gradsync::parameter("weight", f.weight, f.grad)};
    }
};
// [/model-traits]

// [framework-family]
// A framework's tensors own their memory and hand out raw pointers; its module types share one
// base. One partial specialization of model_traits, constrained on the base, covers them all, and
// each tensor goes through the raw-pointer form parameter(name, data, grad, count, shape).
namespace tiny {
struct Tensor {
    std::vector<std::size_t> sizes;
    std::vector<float> storage;  // empty until allocated
    float* data_ptr() { return storage.empty() ? nullptr : storage.data(); }
    std::size_t numel() const { return storage.size(); }
};
struct Param {
    Tensor value, grad;
    void allocate(std::vector<std::size_t> sizes) {
        std::size_t n = 1;
        for (auto d : sizes) n *= d;
        value = {sizes, std::vector<float>(n)};
        grad = {std::move(sizes), std::vector<float>(n)};
    }
};
struct Module {
    virtual ~Module() = default;
    virtual std::vector<std::pair<std::string, Param*>> named_parameters() = 0;
};
struct Linear : Module {
    Param weight, bias;
    Linear(std::size_t in, std::size_t out) {
        weight.allocate({out, in});
        bias.allocate({out});
    }
    std::vector<std::pair<std::string, Param*>> named_parameters() override {
        return {{"weight", &weight}, {"bias", &bias}};
    }
};
// Learns its input width at the first forward, as PyTorch's LazyLinear does: no parameter before.
struct LazyLinear : Linear {
    std::size_t features;
    explicit LazyLinear(std::size_t out) : Linear(0, 0), features(out) {}
    void forward(std::size_t in) {
        if (weight.value.numel() != 0) return;
        weight.allocate({features, in});
        bias.allocate({features});
    }
};
}  // namespace tiny

template <class M>
requires std::derived_from<M, tiny::Module>
struct gradsync::model_traits<M> {
    static std::vector<gradsync::Parameter> parameters(M& module) {
        std::vector<gradsync::Parameter> out;
        for (auto& [name, p] : module.named_parameters())
            out.push_back(
                gradsync::parameter(name, p->value.data_ptr(), p->grad.data_ptr(), p->value.numel(), p->value.sizes));
        return out;
    }
};
// [/framework-family]

int main() {
    Net net{std::vector<float>(784 * 512), std::vector<float>(512),       std::vector<float>(512 * 10),
            std::vector<float>(10),        std::vector<float>(784 * 512), std::vector<float>(512),
            std::vector<float>(512 * 10),  std::vector<float>(10)};

    // A GPT-2 small layout (12 layers, 768 channels, vocabulary 50257, context 1024).
    const std::size_t V = 50257, C = 768, L = 12, T = 1024;
    GPT2 gpt2{nullptr,
              nullptr,
              {V * C, T * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C, L * C, L * C, L * 4 * C * C,
               L * 4 * C, L * C * 4 * C, L * C, C, C}};
    std::size_t total = 0;
    for (auto s : gpt2.param_sizes) total += s;
    std::vector<float> params(total), grads(total);
    gpt2.params_memory = params.data();
    gpt2.grads_memory = grads.data();

    Frozen frozen;

    auto ranks = gradsync::LocalBackend::create_group(1);
    gradsync::DataParallel net_dp(net, ranks[0]);
    gradsync::DataParallel gpt2_dp(gpt2, ranks[0]);
    gradsync::DataParallel frozen_dp(frozen, ranks[0]);
    tiny::Linear linear(784, 512);
    gradsync::DataParallel linear_dp(linear, ranks[0]);

    // [lazy-modules]
    tiny::LazyLinear lazy(10);
    lazy.forward(/*in=*/512);  // the first forward makes the weight: wrap the model after it
    gradsync::DataParallel lazy_dp(lazy, ranks[0]);
    // [/lazy-modules]
    std::printf("Net: %s\n\nGPT-2 small (%zu parameters): %s\n\nFrozen: %s\n",
                gradsync::to_string(net_dp.plan()).c_str(), total, gradsync::to_string(gpt2_dp.plan()).c_str(),
                gradsync::to_string(frozen_dp.plan()).c_str());
    std::printf(
        "\ntiny::Linear (%zu parameters): %s\n\ntiny::LazyLinear after its first forward (%zu parameters): %s\n",
        linear_dp.parameters().size(), gradsync::to_string(linear_dp.plan()).c_str(), lazy_dp.parameters().size(),
        gradsync::to_string(lazy_dp.plan()).c_str());
}
