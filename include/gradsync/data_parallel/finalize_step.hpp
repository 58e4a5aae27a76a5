// The finalize step: after the buckets' reductions, what the finalize pass measured (the sum of
// squares of the averaged, unscaled gradients, and so whether every one is finite), read once per
// step; a float16 wire sum that overflowed, reduced again in float32; clipping by the global
// norm; and the step's decision: the optimizer runs, with the LR rule's rate, only when every
// gradient is finite, and the loss scaler learns the outcome either way. The decision is taken on
// the reduced gradients, which every rank holds alike, so every rank decides alike.
#pragma once

#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/data_parallel/bucket_engine.hpp>
#include <gradsync/data_parallel/readiness.hpp>
#include <gradsync/detail/log.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/lr.hpp>

#include <cmath>  // for std::sqrt, std::isfinite
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>  // for std::is_invocable_v
#include <vector>

namespace gradsync::inline v0 {

// What step() did.
struct StepReport {
    bool applied = false;       // the optimizer ran: every gradient was finite
    float loss_scale = 1;       // the scale this step's gradients carried
    float next_loss_scale = 1;  // the scale for the next step's loss
    double grad_norm = 0;       // L2 norm of all averaged, unscaled gradients, before clipping; not finite on overflow
    bool clipped = false;       // the gradients were scaled down to Options::clip_norm
    double learning_rate = 0;   // what the LR policy gave the optimizer (0 without one)
    std::uint64_t step = 0;     // 1 for the first step
    std::vector<std::string> overflowed;  // parameters whose gradients were not finite
    // Since the previous step() returned (the first: since the front was made): the time, and the
    // bytes this rank handed to the gradients' collectives (at the wire's dtype, a float32 redo
    // included). Of this step() itself, the time outside the optimizer: the synchronization that
    // backward did not hide, and the step's checks.
    double step_seconds = 0;
    std::uint64_t bytes_reduced = 0;
    double sync_seconds = 0;
};

namespace detail {

// The finalize pass's findings in one step.
struct StepStats {
    double sum_squares = 0;                // of the unscaled averaged gradients
    std::vector<std::size_t> nonfinite{};  // parameters with an infinity or NaN
    bool clipped = false;

    [[nodiscard]] double norm() const { return std::sqrt(sum_squares); }
    [[nodiscard]] bool finite() const { return std::isfinite(sum_squares); }
};

// Reads the buckets' measurements once (from the device: the one host synchronization of a step
// that needs them). A float16 wire sum that overflowed left its gradients as they were: that
// bucket is reduced again in float32 (redo(b) does it) and measured again. A bucket that is not
// finite is measured again tensor by tensor, to name its parameters.
template <class Engine, class Redo>
StepStats collect_stats(Engine& engine, Redo&& redo) {
    StepStats stats;
    auto slots = engine.slots();
    bool any = false;
    for (const auto& slot : slots) any = any || slot.measured;
    if (!any) return stats;
    auto sums = engine.memory().results();
    bool again = false;
    for (std::size_t b = 0; b < slots.size(); ++b) {
        const auto& slot = slots[b];
        if (slot.measured && slot.template reduced_by<WireAllreduce>() && slot.wire == DType::float16 &&
            !std::isfinite(sums[b])) {
            redo(b);
            again = true;
        }
    }
    if (again) sums = engine.memory().results();
    for (std::size_t b = 0; b < slots.size(); ++b) {
        auto& slot = slots[b];
        if (!slot.measured) continue;
        slot.measured = false;
        stats.sum_squares += sums[b];
        if (std::isfinite(sums[b])) continue;
        const auto per_tensor = engine.memory().segment_sums(slot.table);
        for (std::size_t k = 0; k < per_tensor.size(); ++k)
            if (!std::isfinite(per_tensor[k])) stats.nonfinite.push_back(slot.indices[k]);
    }
    return stats;
}

// Scales every gradient down to `clip_norm` when the global norm exceeds it: a second pass, only
// when it changes something.
template <class Engine>
void clip(Engine& engine, StepStats& stats, double clip_norm) {
    const double norm = stats.norm();
    if (!std::isfinite(norm) || norm <= clip_norm) return;
    engine.scale_all(clip_norm / (norm + 1e-6));
    stats.clipped = true;
}

// What step(optimizer) calls: optimizer(learning rate) or optimizer() with an LR rule,
// optimizer() without one.
template <class Optimizer, bool HasLrRule>
constexpr bool check_optimizer() {
    static_assert(!HasLrRule || std::is_invocable_v<Optimizer&, double> || std::is_invocable_v<Optimizer&>,
                  "gradsync: step(optimizer) calls optimizer(double learning_rate) or optimizer()");
    static_assert(HasLrRule || std::is_invocable_v<Optimizer&>,
                  "gradsync: without an LR policy (UnscaledLr, LinearLr, SqrtLr) step(optimizer) calls optimizer() "
                  "with no arguments");
    return true;
}

// step_on_device() decides on the device: nothing may need the host to decide.
template <class Scaler, class Compression>
constexpr bool check_step_on_device() {
    static_assert(!adaptive_loss_scale<Scaler>,
                  "gradsync: step_on_device() cannot update a DynamicLossScale, which decides on the host; use step(), "
                  "or StaticLossScale");
    static_assert(!Compression::compresses,
                  "gradsync: step_on_device() with wire compression: a float16 overflow is reduced again in float32, "
                  "which the host decides; use step()");
    return true;
}

// What step() (`on_device` false) and step_on_device() refuse before they synchronize: a step
// under no_sync(), which would communicate nothing; clipping on the device, whose norm would have
// to come to the host.
inline void refuse_step(bool accumulating, bool on_device, double clip_norm, int rank) {
    const std::string call = on_device ? "step_on_device()" : "step()";
    if (on_device && clip_norm > 0)
        throw Error(rank_prefix(rank) + ": " + call +
                    " cannot clip: the norm would have to come to the host; use step()");
    if (accumulating)
        throw ReadinessError(rank_prefix(rank) + ": " + call +
                             " under no_sync(); call it after the guard is gone, on the step that synchronizes");
}

// The step's decision: `optimizer` runs when every gradient is finite, given the LR rule's rate
// (optimizer(rate), or optimizer() without a rate or an LR rule); the scaler learns the outcome.
// `name(p)` names parameter p in the report.
template <class Scaler, class Lr, class Optimizer, class Name>
StepReport decide_step(const StepStats& stats, Scaler& scaler, const Lr& lr, int world, std::uint64_t step,
                       Optimizer& optimizer, Name&& name, int rank) {
    StepReport report;
    report.step = step;
    report.loss_scale = scaler.scale();
    report.grad_norm = stats.norm();
    report.clipped = stats.clipped;
    if (stats.finite()) {
        if constexpr (LrRule<Lr>) {
            report.learning_rate = lr.rate(world, step - 1);
            if constexpr (std::is_invocable_v<Optimizer&, double>)
                optimizer(report.learning_rate);
            else
                optimizer();
        } else {
            optimizer();
        }
        report.applied = true;
    } else {
        for (auto p : stats.nonfinite) report.overflowed.push_back(name(p));
    }
    scaler.update(!report.applied);
    report.next_loss_scale = scaler.scale();
    if (!report.applied && report.next_loss_scale >= report.loss_scale && adaptive_loss_scale<Scaler>)
        log(LogLevel::info, rank,
            "step " + std::to_string(report.step) + " skipped at the minimum loss scale " +
                std::to_string(report.loss_scale) + "; " + std::to_string(report.overflowed.size()) +
                " parameters overflowed, the first '" +
                (report.overflowed.empty() ? std::string("?") : report.overflowed.front()) + "'");
    return report;
}

}  // namespace detail
}  // namespace gradsync::inline v0
