// Learning-rate rules: the learning rate for the global batch (micro-batch x accumulation steps x
// world size) from the base rate tuned for a reference batch, unscaled, linearly or by the square
// root, with an optional gradual warm-up (Goyal et al. 2017). PaddlePaddle's `base_lr * num_gpus`
// is LinearLr with the reference batch equal to the micro-batch.
#pragma once

#include <gradsync/detail/number_text.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/error.hpp>

#include <cmath>     // for std::sqrt
#include <concepts>  // for std::convertible_to
#include <cstdint>
#include <string>
#include <type_traits>  // for std::is_same_v

namespace gradsync::inline v0 {

enum class LrScaling : unsigned char { none, linear, square_root };

// The learning rate at `step` (0 for the first): base_lr scaled for global_batch against
// reference_batch; during the first warmup_steps steps it rises linearly from base_lr, reaching
// the scaled rate at step warmup_steps. A pure function: usable with any optimizer.
inline double learning_rate(double base_lr, LrScaling scaling, std::uint64_t reference_batch,
                            std::uint64_t global_batch, std::uint64_t step, std::uint64_t warmup_steps = 0) {
    if (reference_batch == 0 || global_batch == 0)
        throw Error("gradsync: learning_rate needs a reference batch and a global batch above 0, got " +
                    std::to_string(reference_batch) + " and " + std::to_string(global_batch));
    const double ratio = static_cast<double>(global_batch) / static_cast<double>(reference_batch);
    double target = base_lr;
    if (scaling == LrScaling::linear) target = base_lr * ratio;
    if (scaling == LrScaling::square_root) target = base_lr * std::sqrt(ratio);
    if (step >= warmup_steps) return target;
    return base_lr + (target - base_lr) * (static_cast<double>(step) / static_cast<double>(warmup_steps));
}

// The LR policies of DataParallel: step() passes rate(world size, step) to the optimizer.
template <LrScaling Scaling>
struct ScaledLr {
    using policy_category = policy_category::lr_rule;

    double base_lr = 0;
    std::uint64_t micro_batch = 1;         // examples per rank per backward
    std::uint64_t reference_batch = 0;     // the batch base_lr was tuned for; 0: micro_batch
    std::uint64_t accumulation_steps = 1;  // backwards per step (no_sync micro-steps + 1)
    std::uint64_t warmup_steps = 0;

    [[nodiscard]] std::uint64_t global_batch(int world_size) const {
        return micro_batch * accumulation_steps * static_cast<std::uint64_t>(world_size);
    }
    [[nodiscard]] std::string settings() const {
        const char* kind = Scaling == LrScaling::none ? "unscaled" : Scaling == LrScaling::linear ? "linear" : "sqrt";
        return std::string(kind) + ", base " + detail::exact_text(base_lr) + ", micro batch " +
               std::to_string(micro_batch) + ", reference batch " + std::to_string(reference_batch) +
               ", accumulation " + std::to_string(accumulation_steps) + ", warm-up " + std::to_string(warmup_steps);
    }
    [[nodiscard]] std::string invalid() const {
        if (std::isfinite(base_lr) && base_lr >= 0 && micro_batch != 0 && accumulation_steps != 0) return {};
        return "an LR rule needs a finite base_lr of at least 0, a micro_batch and accumulation_steps above 0";
    }
    [[nodiscard]] double rate(int world_size, std::uint64_t step) const {
        return learning_rate(base_lr, Scaling, reference_batch != 0 ? reference_batch : micro_batch,
                             global_batch(world_size), step, warmup_steps);
    }
};

using UnscaledLr = ScaledLr<LrScaling::none>;
using LinearLr = ScaledLr<LrScaling::linear>;
using SqrtLr = ScaledLr<LrScaling::square_root>;

// No LR policy: step() calls the optimizer without a learning rate. The default.
struct NoLrRule {
    using policy_category = policy_category::lr_rule;
    [[nodiscard]] std::string settings() const { return "none"; }
};

// An LR rule gives the learning rate step() passes to the optimizer, from the world size and the
// step number (from 0). NoLrRule is none: step() then calls the optimizer without one.
template <class R>
concept LrRule = detail::has_settings<R> && requires(const R& r, int world, std::uint64_t step) {
    { r.rate(world, step) } -> std::convertible_to<double>;
};

namespace detail {

template <class R>
constexpr bool check_lr_rule() {
    static_assert(std::is_same_v<R, NoLrRule> || LrRule<R>,
                  "gradsync: an LR rule policy needs `double rate(int world_size, std::uint64_t step) const` (or "
                  "use gradsync::NoLrRule for none)");
    return true;
}

}  // namespace detail

}  // namespace gradsync::inline v0
