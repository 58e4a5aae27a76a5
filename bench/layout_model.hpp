// Models with no computation behind them, only a real network's gradient layout: one separately
// allocated buffer per tensor (as most frameworks hold them), or one blob for all (as llm.c).
#pragma once

#include <gradsync/model/contiguous_parameters.hpp>
#include <gradsync/model/model.hpp>

#include "model_layouts.hpp"

#include <vector>

namespace bench {

// T: the dtype of values and gradients (float, or gradsync::bfloat16 for a mixed-precision model).
template <class T>
class BasicLayoutModel {
public:
    explicit BasicLayoutModel(const std::vector<layouts::Tensor>& tensors) : tensors_(tensors) {
        for (const auto& t : tensors) {
            values_.emplace_back(t.count, T(0.5f));
            grads_.emplace_back(t.count, T(1.0f));
        }
    }
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        for (std::size_t i = 0; i < tensors_.size(); ++i)
            out.push_back(gradsync::parameter(tensors_[i].name, values_[i], grads_[i], tensors_[i].shape));
        return out;
    }
    // The gradient tensors, e.g. for a reference that reduces the very same memory.
    std::vector<std::vector<T>>& gradients() { return grads_; }

private:
    std::vector<layouts::Tensor> tensors_;
    std::vector<std::vector<T>> values_, grads_;
};
using LayoutModel = BasicLayoutModel<float>;

class BlobModel {
public:
    explicit BlobModel(const std::vector<layouts::Tensor>& tensors)
        : values_(layouts::total_count(tensors), 0.5f), grads_(values_.size(), 1.0f) {
        for (const auto& t : tensors) sizes_.push_back(t.count);
    }
    std::vector<gradsync::Parameter> parameters() {
        return gradsync::ContiguousParameters<float>(values_.data(), grads_.data(), sizes_).parameters();
    }

private:
    std::vector<float> values_, grads_;
    std::vector<std::size_t> sizes_;
};

}  // namespace bench
