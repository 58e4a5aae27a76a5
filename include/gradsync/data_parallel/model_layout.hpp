// The model as DataParallel sees it: its parameters in registration order without the zero-sized
// ones (the list bucket plans index into), the model's own index of each, its parameters by name,
// and its buffers.
#pragma once

#include <gradsync/model/buffers.hpp>
#include <gradsync/model/model.hpp>

#include <cstddef>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>  // for std::move
#include <variant>
#include <vector>

namespace gradsync::inline v0::detail {

struct ModelLayout {
    static constexpr std::size_t none = static_cast<std::size_t>(-1);  // a zero-sized parameter
    static constexpr std::size_t ambiguous = none - 1;                 // a name several parameters have

    std::vector<Parameter> params;
    std::vector<ModelBuffer> buffers;
    std::vector<std::size_t> param_of_model_index;  // none for zero-sized parameters
    std::unordered_map<std::string, std::size_t> by_name;

    template <class Model>
    static ModelLayout of(Model& model, bool with_buffers) {
        ModelLayout out;
        const auto listed = gradsync::parameters(model);
        for (std::size_t i = 0; i < listed.size(); ++i) {
            if (listed[i].count == 0) {
                out.param_of_model_index.push_back(none);
            } else {
                out.param_of_model_index.push_back(out.params.size());
                out.params.push_back(listed[i]);
            }
            auto [it, fresh] = out.by_name.emplace(listed[i].name, out.param_of_model_index.back());
            if (!fresh) it->second = ambiguous;
        }
        if (with_buffers)
            for (auto& b : gradsync::buffers(model))
                if (b.count != 0) out.buffers.push_back(std::move(b));
        return out;
    }

    // The parameter at the model's `index` (zero-sized: none), or an error message.
    [[nodiscard]] std::variant<std::size_t, std::string> at_model_index(std::size_t index) const {
        if (index < param_of_model_index.size()) return param_of_model_index[index];
        return "grad_ready(" + std::to_string(index) + ") but the model has " +
               std::to_string(param_of_model_index.size()) + " parameters";
    }
    // The parameter named `name` (zero-sized: none), or an error message.
    [[nodiscard]] std::variant<std::size_t, std::string> named(std::string_view name) const {
        auto it = by_name.find(std::string(name));
        if (it != by_name.end() && it->second != ambiguous) return it->second;
        return "grad_ready(\"" + std::string(name) + "\"): " +
               (it == by_name.end() ? "no parameter has this name"
                                    : "several parameters have this name; use grad_ready(index)");
    }
};

}  // namespace gradsync::inline v0::detail
