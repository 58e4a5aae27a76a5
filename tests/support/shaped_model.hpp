// A model that states its tensors' shapes: a 2x3 weight, a bias, a 0-d scale, and an int64 0-d
// batch counter and a float running mean as buffers, as a framework's model would list them.
#pragma once

#include <gradsync/model/buffers.hpp>
#include <gradsync/model/model.hpp>

#include <cstdint>
#include <vector>

namespace testing_support {

struct Shaped {
    std::vector<float> weight = std::vector<float>(6), weight_grad = std::vector<float>(6);
    std::vector<float> bias = std::vector<float>(3), bias_grad = std::vector<float>(3);
    std::vector<float> scale = std::vector<float>(1), scale_grad = std::vector<float>(1);
    std::vector<float> running_mean = std::vector<float>(3);
    std::vector<std::int64_t> batches = std::vector<std::int64_t>(1);

    // Every value a function of `seed`.
    explicit Shaped(float seed) {
        for (std::size_t i = 0; i < weight.size(); ++i) weight[i] = seed + 0.5f * static_cast<float>(i);
        for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = seed - static_cast<float>(i);
        scale[0] = seed * 2;
        for (std::size_t i = 0; i < running_mean.size(); ++i) running_mean[i] = seed + 0.25f * static_cast<float>(i);
        batches[0] = static_cast<std::int64_t>(seed) + 7;
    }
    std::vector<gradsync::Parameter> parameters() {
        return {gradsync::parameter("layer.weight", weight, weight_grad, {2, 3}),
                gradsync::parameter("layer.bias", bias, bias_grad, {3}),
                gradsync::parameter("scale", scale, scale_grad)};
    }
    std::vector<gradsync::ModelBuffer> buffers() {
        return {gradsync::model_buffer("bn.running_mean", running_mean, {3}),
                gradsync::model_buffer("bn.num_batches_tracked", batches)};
    }
};

}  // namespace testing_support
