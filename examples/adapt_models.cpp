// The ways a model tells gradsync its parameters, each in a few lines; README.md quotes the
// regions between the [name] markers. Run it to see each model's bucket plan.
#include <gradsync/gradsync.hpp>

#include <array>
#include <cstdio>
#include <string_view>
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
    std::printf("Net: %s\n\nGPT-2 small (%zu parameters): %s\n\nFrozen: %s\n",
                gradsync::to_string(net_dp.plan()).c_str(), total, gradsync::to_string(gpt2_dp.plan()).c_str(),
                gradsync::to_string(frozen_dp.plan()).c_str());
}
