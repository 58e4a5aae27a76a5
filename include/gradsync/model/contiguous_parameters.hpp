// ContiguousParameters: a model adapter for the llm.c layout, where every parameter lives in one
// blob, every gradient in a second blob of the same layout, and a table gives each tensor's size.
#pragma once

#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/model/model.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gradsync::inline v0 {

template <HasDType T>
class ContiguousParameters {
public:
    // `sizes[i]` is the element count of tensor i; tensors follow each other without gaps.
    // `names` is empty (tensors are called "param0", "param1", ...) or one name per tensor.
    ContiguousParameters(T* params, T* grads, std::span<const std::size_t> sizes,
                         std::span<const std::string_view> names = {})
        : params_(params), grads_(grads), sizes_(sizes.begin(), sizes.end()) {
        if (!names.empty() && names.size() != sizes.size()) {
            throw InvalidModel("gradsync: ContiguousParameters got " + std::to_string(sizes.size()) +
                               " tensor sizes but " + std::to_string(names.size()) +
                               " names; give one name per tensor or none");
        }
        names_.reserve(sizes.size());
        for (std::size_t i = 0; i < sizes.size(); ++i) {
            names_.push_back(names.empty() ? "param" + std::to_string(i) : std::string(names[i]));
        }
    }

    [[nodiscard]] std::vector<Parameter> parameters() const {
        std::vector<Parameter> out;
        out.reserve(sizes_.size());
        std::size_t offset = 0;
        for (std::size_t i = 0; i < sizes_.size(); ++i) {
            // A gradient blob not allocated yet (llm.c makes it in the first backward): no gradients.
            T* grad = grads_ == nullptr ? nullptr : grads_ + offset;
            out.push_back(gradsync::parameter(names_[i], params_ + offset, grad, sizes_[i]));
            offset += sizes_[i];
        }
        return out;
    }

    [[nodiscard]] std::size_t total_count() const {
        std::size_t n = 0;
        for (auto s : sizes_) n += s;
        return n;
    }
    [[nodiscard]] T* params() const { return params_; }
    [[nodiscard]] T* grads() const { return grads_; }

private:
    T* params_;
    T* grads_;
    std::vector<std::size_t> sizes_;
    std::vector<std::string> names_;
};

}  // namespace gradsync::inline v0
