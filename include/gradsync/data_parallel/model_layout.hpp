// The model as DataParallel sees it: its parameters in registration order without the zero-sized
// ones (the list bucket plans index into), the model's own index of each, its parameters by name,
// and its buffers; and where their storage is now, when it moves between steps.
#pragma once

#include <gradsync/model/buffers.hpp>
#include <gradsync/model/model.hpp>

#include <cstddef>
#include <span>
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
    std::vector<std::size_t> model_index_of_param;
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
                out.model_index_of_param.push_back(i);
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

    // `listed`, the model's parameters now (to follow storage that moves between steps: a
    // framework that frees gradients and allocates new ones in backward), if there are as many as
    // at construction; another number is an InvalidModel error, where() begins its message.
    template <class Where>
    std::vector<Parameter> checked(std::vector<Parameter> listed, const Where& where) const {
        if (listed.size() != param_of_model_index.size())
            throw InvalidModel(where() + ": the model lists " + std::to_string(listed.size()) +
                               " parameters now and listed " + std::to_string(param_of_model_index.size()) +
                               " when the DataParallel was made; its parameters cannot change under a "
                               "DataParallel (make a new one)");
        for (std::size_t i = 0; i < listed.size(); ++i)  // empty then: never averaged if made now
            if (param_of_model_index[i] == none && listed[i].count != 0)
                throw InvalidModel(where() + ": parameter '" + listed[i].name +
                                   "' had no elements when the DataParallel was made and has " +
                                   std::to_string(listed[i].count) +
                                   " now (made at the first forward?), so it would never be averaged; run one "
                                   "forward before wrapping the model (or make a new DataParallel now, on every "
                                   "rank)");
        return listed;
    }

    // Follows the storage of the parameters `which` to where `listed` says it is now; returns
    // whether any moved. A parameter that changed name, size or dtype, lost its values or
    // gradient, or whose values moved, is an InvalidModel error naming it.
    template <class Where>
    bool follow(const std::vector<Parameter>& listed, std::span<const std::size_t> which, const Where& where) {
        bool moved = false;
        for (auto p : which) {
            auto& mine = params[p];
            const auto& now = listed[model_index_of_param[p]];
            if (now.name != mine.name)  // the names every rank agreed on
                throw InvalidModel(where() + ": parameter " + std::to_string(model_index_of_param[p]) + " was '" +
                                   mine.name + "' when the DataParallel was made and is listed as '" + now.name +
                                   "' now; the parameter list every rank agreed on cannot change under a "
                                   "DataParallel (make a new one)");
            if (now.count != mine.count || now.dtype != mine.dtype)
                throw InvalidModel(where() + ": parameter '" + mine.name + "' was " + std::to_string(mine.count) +
                                   " x " + std::string(to_string(mine.dtype)) + " and is now " +
                                   std::to_string(now.count) + " x " + std::string(to_string(now.dtype)) +
                                   "; its storage may move between steps, but not change size or type");
            if (now.grad == nullptr || now.data == nullptr)
                throw InvalidModel(where() + ": parameter '" + mine.name + "' has no " +
                                   (now.data == nullptr ? "values" : "gradient") +
                                   " now; a gradient made late (in the first backward) or freed between steps "
                                   "must exist by the time its bucket is reduced, in synchronize() at the latest");
            if (now.data != mine.data)  // values another rank cannot know of: a module replaced, say
                throw InvalidModel(where() + ": the values of parameter '" + mine.name +
                                   "' lie in other memory now, and may differ from the other ranks' (a module or "
                                   "tensor replaced on this rank?); parameter values must stay where they are under "
                                   "a DataParallel (make a new one, on every rank, after replacing them)");
            if (now.grad == mine.grad) continue;
            mine.grad = now.grad;
            moved = true;
        }
        return moved;
    }

    // The parameter at the model's `index` (zero-sized: none), or an error message.
    [[nodiscard]] std::variant<std::size_t, std::string> at_model_index(std::size_t index,
                                                                        std::string_view call = "grad_ready") const {
        if (index < param_of_model_index.size()) return param_of_model_index[index];
        return std::string(call) + "(" + std::to_string(index) + ") but the model has " +
               std::to_string(param_of_model_index.size()) + " parameters";
    }
    // The parameter named `name` (zero-sized: none), or an error message.
    [[nodiscard]] std::variant<std::size_t, std::string> named(std::string_view name,
                                                               std::string_view call = "grad_ready") const {
        auto it = by_name.find(std::string(name));
        if (it != by_name.end() && it->second != ambiguous) return it->second;
        return std::string(call) + "(\"" + std::string(name) + "\"): " +
               (it == by_name.end() ? "no parameter has this name"
                                    : "several parameters have this name; use " + std::string(call) + "(index)");
    }
};

}  // namespace gradsync::inline v0::detail
