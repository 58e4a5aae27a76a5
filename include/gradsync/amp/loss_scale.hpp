// Loss scaling for mixed precision: multiply the loss by dp.loss_scale() before backward, and
// DataParallel divides the reduced gradients by the same scale in its finalize pass; step()
// skips the optimizer when a gradient overflowed and tells the scaler either way.
#pragma once

#include <gradsync/detail/number_text.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::min, std::max
#include <cmath>      // for std::isfinite
#include <concepts>   // for std::convertible_to
#include <cstdint>
#include <string>

namespace gradsync::inline v0 {

// No scaling: the loss is used as it is (float32 training, or bfloat16 with its float range).
struct NoLossScaling {
    using policy_category = policy_category::loss_scaler;
    [[nodiscard]] std::string settings() const { return "none"; }
    [[nodiscard]] float scale() const { return 1.0f; }
    void update(bool /*overflow*/) {}
};

// A fixed scale, such as PaddlePaddle's GradScaler(init_loss_scaling=1024,
// use_dynamic_loss_scaling=False). Steps that overflow are still skipped.
struct StaticLossScale {
    using policy_category = policy_category::loss_scaler;
    [[nodiscard]] std::string settings() const { return "static " + detail::exact_text(value); }
    [[nodiscard]] std::string invalid() const {
        if (value > 0 && std::isfinite(value)) return {};
        return "StaticLossScale needs a finite value above 0, got " + std::to_string(value);
    }
    float value = 1024.0f;
    [[nodiscard]] float scale() const { return value; }
    void update(bool /*overflow*/) {}
};

// The scale grows by growth_factor after growth_interval steps in a row without overflow, and
// backs off by backoff_factor after backoff_after overflowing steps in a row, within
// [min_scale, max_scale]. Defaults match PyTorch's GradScaler and PaddlePaddle's (2.5 and later)
// GradScaler: 65536, x2, x0.5, 2000 steps, backing off at every overflow. Unlike both, the scale
// is clamped to [1, 2^24] by default, and an overflow at the minimum is not fatal: the step is
// skipped, the overflowing tensors are reported, and training goes on. backoff_after is
// PaddlePaddle's decr_every_n_nan_or_inf and DeepSpeed's hysteresis.
struct DynamicLossScale {
    using policy_category = policy_category::loss_scaler;
    // The scale follows the gradients (a step's outcome decides the next scale, on the host).
    static constexpr bool adaptive = true;

    float init_scale = 65536.0f;
    float growth_factor = 2.0f;
    float backoff_factor = 0.5f;
    std::uint32_t growth_interval = 2000;
    std::uint32_t backoff_after = 1;
    float min_scale = 1.0f;
    float max_scale = 16777216.0f;

    // What a checkpoint saves and restores.
    struct State {
        float scale = 0;               // 0: not started, init_scale
        std::uint32_t good_steps = 0;  // in a row without overflow
        std::uint32_t bad_steps = 0;   // in a row with overflow
        friend bool operator==(const State&, const State&) = default;
    };
    State state{};

    [[nodiscard]] float scale() const { return state.scale != 0 ? state.scale : clamp(init_scale); }

    void update(bool overflow) {
        check();
        state.scale = scale();
        if (overflow) {
            state.good_steps = 0;
            if (++state.bad_steps >= backoff_after) {
                state.scale = clamp(state.scale * backoff_factor);
                state.bad_steps = 0;
            }
        } else {
            state.bad_steps = 0;
            if (++state.good_steps >= growth_interval) {
                state.scale = clamp(state.scale * growth_factor);
                state.good_steps = 0;
            }
        }
    }

    [[nodiscard]] bool at_minimum() const { return scale() <= min_scale; }

    [[nodiscard]] std::string settings() const {
        return "dynamic, init " + detail::exact_text(init_scale) + ", x" + detail::exact_text(growth_factor) +
               " every " + std::to_string(growth_interval) + ", x" + detail::exact_text(backoff_factor) + " after " +
               std::to_string(backoff_after) + ", within [" + detail::exact_text(min_scale) + ", " +
               detail::exact_text(max_scale) + "]";
    }
    [[nodiscard]] std::string invalid() const {
        if (min_scale > 0 && max_scale >= min_scale && growth_factor >= 1 && backoff_factor > 0 &&
            backoff_factor <= 1 && growth_interval != 0 && backoff_after != 0 && init_scale > 0 &&
            std::isfinite(init_scale) && std::isfinite(max_scale))
            return {};
        return "DynamicLossScale needs 0 < min_scale <= max_scale, a finite init_scale above 0, growth_factor >= 1, "
               "0 < backoff_factor <= 1, growth_interval >= 1 and backoff_after >= 1";
    }

private:
    [[nodiscard]] float clamp(float s) const { return std::min(max_scale, std::max(min_scale, s)); }
    void check() const {
        if (auto why = invalid(); !why.empty()) throw Error("gradsync: " + why);
    }
};

// What DataParallel needs of a loss scaler: the factor the loss is multiplied by, and to learn
// each step's outcome. A scaler whose scale follows the outcomes says `static constexpr bool
// adaptive = true` (step_on_device() cannot decide it on the device).
template <class S>
concept LossScaler = detail::has_settings<S> && requires(S& s, const S& cs, bool overflow) {
    { cs.scale() } -> std::convertible_to<float>;
    s.update(overflow);
};

template <class S>
inline constexpr bool adaptive_loss_scale = requires {
    requires S::adaptive;
};

namespace detail {

template <class S>
constexpr bool check_loss_scaler() {
    static_assert(
        requires(const S& s) {
            { s.scale() } -> std::convertible_to<float>;
        },
        "gradsync: a loss scaler needs `float scale() const`, the factor the loss is multiplied by");
    static_assert(
        requires(S & s, bool overflow) { s.update(overflow); },
        "gradsync: a loss scaler needs `void update(bool overflow)`, told each step whether a gradient was not "
        "finite");
    return true;
}

}  // namespace detail

}  // namespace gradsync::inline v0
