// Replanning: the bucket plan in use and whether it changes between steps, and to what. Owns the
// plan, the bucketer (autotuning changes its caps), the bucket rebuild after the first overlapped
// step (rebuild.hpp) and the autotuner (bucket_tuner.hpp). A new plan is adopted under a lock that
// a peer's diagnosis, on another thread, reads the plan under; DataParallel rebuilds its
// per-bucket state from it there.
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
#include <mutex>
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
    // What changed the plan, to log; `tuned`: autotuning did (noted in the timeline).
    struct Change {
        std::string what;
        bool tuned = false;
    };

    Replanning() = default;
    explicit Replanning(Bucketer bucketer) : bucketer_(std::move(bucketer)) {}

    [[nodiscard]] const Bucketer& bucketer() const { return bucketer_; }
    // The plan in use; read between steps (or through read()).
    [[nodiscard]] const BucketPlan& plan() const { return plan_; }

    // Takes `plan`, and lets `setup(plan)` rebuild the per-bucket state, both under the lock.
    template <class Setup>
    void adopt(BucketPlan plan, Setup&& setup) {
        std::lock_guard lock(mutex_);
        plan_ = std::move(plan);
        setup(plan_);
    }
    // f(plan) under the lock: from another thread (a peer's diagnosis).
    template <class F>
    auto read(F&& f) const {
        std::lock_guard lock(mutex_);
        return f(plan_);
    }

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

    // After a synchronized step (`overlapped`: with grad_ready calls): adopts a new plan (see
    // adopt) when a rebuild or tuning chose one, and says what changed it. Collective when it
    // rebuilds or tuning is due, on every rank alike.
    template <Backend B, class Slots, class Setup>
    std::optional<Change> after_step(B& backend, Readiness& readiness, const Slots& slots,
                                     std::span<const Parameter> params, bool overlapped, Setup&& setup) {
        std::optional<BucketPlan> next;
        Change change;
        if (overlapped && rebuild_) {
            rebuild_ = false;
            next = plan_in_readiness_order(backend, bucketer_, params, readiness.arrivals());
            change = {"buckets rebuilt in rank 0's readiness order", false};
            readiness.stop_recording();
        }
        if constexpr (Tunable) {
            tuner_.observe(
                overlapped && readiness.timing_arrivals() ? readiness.ready_offsets() : std::vector<double>{}, slots,
                readiness.began());
            if (tuner_.due()) {
                if (auto choice = tuner_.choose(backend, bucketer_, plan_, params)) {  // measured under plan_
                    bucketer_ = choice->bucketer;
                    change = {"buckets tuned, " + choice->summary(), true};
                    next = std::move(choice->plan);
                }
                if (!tuner_.active()) readiness.time_arrivals(false);
            }
        }
        if (!next) return std::nullopt;
        adopt(std::move(*next), setup);
        return change;
    }

private:
    Bucketer bucketer_{};
    BucketPlan plan_;
    mutable std::mutex mutex_;
    bool rebuild_ = false;
    BucketTuner tuner_;
};

}  // namespace gradsync::inline v0::detail
