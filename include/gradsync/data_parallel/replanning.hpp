// Replanning between steps: whether the bucket plan changes after a step, and to what. Owns the
// bucketer (autotuning changes its caps), the bucket rebuild after the first overlapped step
// (rebuild.hpp) and the autotuner (bucket_tuner.hpp). DataParallel rebuilds its per-bucket state
// from the plan this returns.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/bucket/tuning.hpp>
#include <gradsync/data_parallel/bucket_tuner.hpp>
#include <gradsync/data_parallel/options.hpp>
#include <gradsync/data_parallel/readiness.hpp>
#include <gradsync/data_parallel/rebuild.hpp>
#include <gradsync/model/model.hpp>

#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace gradsync::inline v0::detail {

// `Tunable`: the bucketer has caps and the host times the collectives (PolicySet::tunable).
// `Rebuildable`: the gradients may be regrouped (not untouchable device gradients, which might
// not stay contiguous).
template <class Bucketer, bool Tunable, bool Rebuildable>
class Replanning {
public:
    // A new plan, and what to log about it; `tuned`: chosen by autotuning (noted in the timeline).
    struct NewPlan {
        BucketPlan plan;
        std::string what;
        bool tuned = false;
    };

    Replanning() = default;
    explicit Replanning(Bucketer bucketer) : bucketer_(std::move(bucketer)) {}

    [[nodiscard]] const Bucketer& bucketer() const { return bucketer_; }

    // At construction, once the plan is set up: what the first steps record. `autotune`: whether
    // Options::autotune_buckets, resolved, is on.
    void start(const Options& options, bool autotune, int world_size, Readiness& readiness) {
        rebuild_ = options.rebuild_buckets && Rebuildable;
        if (rebuild_) readiness.record_arrivals();
        if constexpr (Tunable) {
            tuner_ = BucketTuner(autotune && world_size > 1);
            readiness.time_arrivals(tuner_.active());
        }
    }

    // Whether launches are timed (a clock read before and after each), and one's time.
    [[nodiscard]] bool timing_launches() const { return tuner_.active(); }
    void launch_took(std::chrono::steady_clock::duration d) {
        tuner_.launch_took(std::chrono::duration<double>(d).count());
    }

    // After a synchronized step (`overlapped`: with grad_ready calls), under `plan`. Collective
    // when it rebuilds or tuning is due, on every rank alike.
    template <Backend B, class Slots>
    std::optional<NewPlan> after_step(B& backend, Readiness& readiness, const Slots& slots, const BucketPlan& plan,
                                      std::span<const Parameter> params, bool overlapped) {
        std::optional<NewPlan> out;
        if (overlapped && rebuild_) {
            rebuild_ = false;
            out = NewPlan{plan_in_readiness_order(backend, bucketer_, params, readiness.arrivals()),
                          "buckets rebuilt in rank 0's readiness order", false};
            readiness.stop_recording();
        }
        if constexpr (Tunable) {
            tuner_.observe(
                overlapped && readiness.timing_arrivals() ? readiness.ready_offsets() : std::vector<double>{}, slots);
            if (!tuner_.due()) return out;
            if (auto choice = tuner_.choose(backend, bucketer_, plan, params)) {  // measured under `plan`
                bucketer_ = choice->bucketer;
                auto what = "buckets tuned, " + choice->summary();
                out = NewPlan{std::move(choice->plan), std::move(what), true};
            }
            if (!tuner_.active()) readiness.time_arrivals(false);
        }
        return out;
    }

private:
    Bucketer bucketer_{};
    bool rebuild_ = false;
    BucketTuner tuner_;
};

}  // namespace gradsync::inline v0::detail
