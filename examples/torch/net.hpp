// The model and data of the torch examples: an MLP classifying points of a synthetic task, whose
// batches are the same for every run (seeded by the step).
#pragma once

#include <torch/torch.h>

#include <utility>

struct NetImpl : torch::nn::Module {
    NetImpl() {
        fc1 = register_module("fc1", torch::nn::Linear(32, 64));
        bn = register_module("bn", torch::nn::BatchNorm1d(64));
        fc2 = register_module("fc2", torch::nn::Linear(64, 10));
    }
    torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
    torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

// Step `step`'s batch of `size` examples, or part `part` of `parts` of it: the label is the
// index of the largest of the first 10 inputs.
inline std::pair<torch::Tensor, torch::Tensor> make_batch(int step, int size, int part = 0, int parts = 1) {
    auto generator = at::detail::createCPUGenerator(static_cast<std::uint64_t>(1000 + step));
    auto x = torch::randn({size, 32}, generator);
    auto y = x.narrow(1, 0, 10).argmax(1);
    const int share = size / parts;
    return {x.narrow(0, part * share, share), y.narrow(0, part * share, share)};
}
