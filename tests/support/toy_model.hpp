// Toy: a model of named float (and optionally double) tensors with integer-valued gradients, so
// that averages are exact and tests can demand bitwise equality.
#pragma once

#include <gradsync/model/buffers.hpp>
#include <gradsync/model/model.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace testing_support {

struct Toy {
    struct Tensor {
        std::string name;
        std::vector<float> w, g;
    };
    struct Tensor64 {
        std::string name;
        std::vector<double> w, g;
    };
    std::vector<Tensor> tensors;
    std::vector<Tensor64> doubles;
    std::vector<float> running_mean;     // a buffer, for the buffer policies
    std::vector<std::int64_t> counters;  // an integer buffer

    Toy(const std::vector<std::size_t>& sizes, float value, std::size_t n_doubles = 0) {
        for (std::size_t k = 0; k < sizes.size(); ++k)
            tensors.push_back(
                {"t" + std::to_string(k), std::vector<float>(sizes[k], value), std::vector<float>(sizes[k])});
        for (std::size_t k = 0; k < n_doubles; ++k)
            doubles.push_back(
                {"d" + std::to_string(k), std::vector<double>(100 + k, value), std::vector<double>(100 + k)});
    }
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        for (auto& t : tensors) out.push_back(gradsync::parameter(t.name, t.w, t.g));
        for (auto& t : doubles) out.push_back(gradsync::parameter(t.name, t.w, t.g));
        return out;
    }
    std::vector<gradsync::ModelBuffer> buffers() {
        std::vector<gradsync::ModelBuffer> out;
        if (!running_mean.empty()) out.push_back(gradsync::model_buffer("bn.running_mean", running_mean));
        if (!counters.empty()) out.push_back(gradsync::model_buffer("bn.num_batches_tracked", counters));
        return out;
    }
    // Gradient element i of tensor k on `rank`: small integers, so sums are exact.
    static float grad_value(int rank, std::size_t k, std::size_t i) {
        return static_cast<float>((rank + 1) * static_cast<int>(k + 1) + static_cast<int>(i % 7));
    }
    void fill_grads(int rank) {
        for (std::size_t k = 0; k < tensors.size(); ++k)
            for (std::size_t i = 0; i < tensors[k].g.size(); ++i) tensors[k].g[i] = grad_value(rank, k, i);
        for (std::size_t k = 0; k < doubles.size(); ++k)
            for (std::size_t i = 0; i < doubles[k].g.size(); ++i) doubles[k].g[i] = grad_value(rank, k, i);
    }
    std::size_t parameter_count() const { return tensors.size() + doubles.size(); }
};

template <class T>
T expected_average(int world, std::size_t k, std::size_t i) {
    T sum = 0;
    for (int r = 0; r < world; ++r) sum += static_cast<T>(Toy::grad_value(r, k, i));
    return world == 1 ? sum : sum * (T(1) / static_cast<T>(world));
}

}  // namespace testing_support
