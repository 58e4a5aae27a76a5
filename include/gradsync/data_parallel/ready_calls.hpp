// What both fronts do with the trainer's grad_ready calls: a parameter found by index or name
// becomes ready in the step's Readiness (launching the buckets it completes), and at the end of
// backward every parameter without a call is accounted for or named in the error.
#pragma once

#include <gradsync/data_parallel/diagnosis.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/readiness.hpp>
#include <gradsync/error.hpp>

#include <cstddef>
#include <string>
#include <variant>

namespace gradsync::inline v0::detail {

// The parameter a call (grad_ready, param_ready) named, as ModelLayout::at_model_index or named
// found it (ModelLayout::none: a zero-sized one), or what was wrong with the call thrown as a
// ReadinessError that where() (rank and step) begins.
template <class Where>
std::size_t named_parameter(const std::variant<std::size_t, std::string>& found, const Where& where) {
    if (const auto* problem = std::get_if<std::string>(&found)) throw ReadinessError(where() + ": " + *problem);
    return std::get<std::size_t>(found);
}

// `found`: the parameter a grad_ready call named (ModelLayout::at_model_index or named), or what
// was wrong with the call. Launches through launch(b) every bucket it completes, in plan order; a
// misuse is a ReadinessError that where() (rank and step) begins.
template <class Launch, class Where>
void mark_ready(Readiness& readiness, const ModelLayout& layout, const std::variant<std::size_t, std::string>& found,
                Launch&& launch, const Where& where) {
    const auto p = named_parameter(found, where);
    if (p == ModelLayout::none) return;
    if (readiness.mark(p, launch) == Readiness::Mark::twice)
        throw ReadinessError(where() + ": grad_ready for parameter '" + layout.params[p].name +
                             "' was called twice in one step");
}

// At the end of an overlapped backward: every parameter without a grad_ready call is either ready
// from an earlier micro-step, unused (unused(p) returns true once it has zeroed its gradient) or
// an error naming them; then every bucket goes through launch(b).
template <class Launch, class Unused, class Where>
void complete_readiness(Readiness& readiness, const ModelLayout& layout, Launch&& launch, Unused&& unused,
                        const Where& where) {
    const auto missing = readiness.complete(launch, unused);
    if (!missing.empty()) throw ReadinessError(where() + ": " + missing_gradients(missing, layout.params, readiness));
}

}  // namespace gradsync::inline v0::detail
