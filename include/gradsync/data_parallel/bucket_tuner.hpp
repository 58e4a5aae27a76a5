// Bucket autotuning over the first steps: each overlapped step notes when every gradient became
// ready, how long each bucket's collective took and how much communication was left after
// backward; every few steps the ranks pool what they measured, rank 0 chooses the caps that expose
// the least communication after backward (bucket/tuning.hpp) and every rank takes its choice. At
// most `rounds` choices, then it stops measuring.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/bucket/tuning.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::max, std::max_element, std::min_element, std::nth_element, std::stable_sort
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>   // for std::snprintf
#include <numeric>  // for std::iota
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

class BucketTuner {
public:
    static constexpr int rounds = 2;           // plans chosen at most
    static constexpr int steps_per_round = 4;  // synchronized steps between two choices
    static constexpr int idle_decisions = 16;  // choices without any measurement before giving up

    // What a choice changed.
    template <class B>
    struct Choice {
        B bucketer;
        BucketPlan plan;
        double exposure_before = 0, exposure_after = 0;  // predicted, seconds
        CollectiveCost cost;
        double exposure_measured = 0;  // under the plan before, seconds

        // "cap 4 MiB, first cap 256 KiB: 27 buckets; predicted exposed 0.81 ms after backward
        // (2.90 ms before, 3.10 measured); a collective takes 21 us + 0.360 ns per byte, its launch
        // 12 us (0 % of it lengthening backward)"
        [[nodiscard]] std::string summary() const {
            char figures[320];
            std::snprintf(figures, sizeof figures,
                          "; predicted exposed %.2f ms after backward (%.2f ms before, %.2f measured); a collective "
                          "takes %.0f us + %.3f ns per byte, its launch %.0f us (%.0f %% of it lengthening backward)",
                          exposure_after * 1e3, exposure_before * 1e3, exposure_measured * 1e3, cost.latency * 1e6,
                          cost.per_byte * 1e9, cost.launch * 1e6, cost.stall * 100);
            return "cap " + to_string(bucketer.cap) + ", first cap " + to_string(bucketer.first_cap) + ": " +
                   std::to_string(plan.buckets.size()) + (plan.buckets.size() == 1 ? " bucket" : " buckets") + figures;
        }
    };

    BucketTuner() = default;
    explicit BucketTuner(bool on) : active_(on) {}

    [[nodiscard]] bool active() const { return active_; }

    // A bucket's launch took the launching thread `seconds` (under the readiness lock).
    void launch_took(double seconds) {
        launch_seconds_ += seconds;
        ++launches_;
    }

    // After a synchronized step. `ready`: seconds after `began` each parameter was ready (empty
    // when nothing overlapped); `slots`: the bucket engine's, with when each collective was
    // launched and finished. The first overlapped step of a plan only warms up.
    template <class Slots>
    void observe(std::span<const double> ready, const Slots& slots, std::chrono::steady_clock::time_point began) {
        if (!active_) return;
        ++steps_;
        if (ready.empty()) return;
        if (!warmed_up_) {
            warmed_up_ = true;
            launch_seconds_ = 0;
            launches_ = 0;
            return;
        }
        std::vector<double> seconds;
        std::chrono::steady_clock::time_point free_at{}, last{};
        for (const auto& slot : slots) {
            if (slot.finished_at == std::chrono::steady_clock::time_point{}) return;  // not timed by the host
            const auto start = std::max(slot.launched_at, free_at);
            seconds.push_back(std::chrono::duration<double>(slot.finished_at - start).count());
            free_at = slot.finished_at;
            last = std::max(last, slot.finished_at);
        }
        const double end_of_backward = *std::max_element(ready.begin(), ready.end());
        exposed_.push_back(std::max(0.0, std::chrono::duration<double>(last - began).count() - end_of_backward));
        ready_.emplace_back(ready.begin(), ready.end());
        durations_.push_back(std::move(seconds));
        launch_.push_back(launches_ > 0 ? launch_seconds_ / static_cast<double>(launches_) : 0.0);
        launch_seconds_ = 0;
        launches_ = 0;
    }

    // Whether this step ends with a choice (on every rank alike: it counts synchronized steps).
    [[nodiscard]] bool due() const { return active_ && steps_ > 0 && steps_ % steps_per_round == 0; }

    // Pools every rank's measurements, lets rank 0 choose and hands its choice to every rank.
    // Collective. Returns the new bucketer and plan when the plan changes.
    template <Backend BackendT, TunableBucketer B>
    std::optional<Choice<B>> choose(BackendT& backend, const B& current, const BucketPlan& plan,
                                    std::span<const Parameter> params) {
        const std::size_t n = params.size();
        // [ranks that measured, latency, seconds per byte, launch, stall, exposed after backward,
        // ready time of each parameter]
        constexpr std::size_t head = 6;
        std::vector<double> pooled(head + n, 0.0);
        if (!ready_.empty()) {
            // Earlier rounds' samples too: their buckets had other sizes, which the fit needs.
            const auto measured = bucket_samples(plan);
            samples_.insert(samples_.end(), measured.begin(), measured.end());
            const auto cost = fit_cost(samples_);
            pooled[0] = 1;
            pooled[1] = cost.latency;
            pooled[2] = cost.per_byte;
            pooled[3] = median(launch_);
            for (std::size_t p = 0; p < n; ++p) pooled[head + p] = median_ready(p);
            pooled[4] = stall_since_last_round(plan, std::span<const double>(pooled).subspan(head), pooled[3]);
            // The least of the steps: an excess every step showed, not one step's hiccup, which
            // charged to every collective would make the next plan much coarser than pays.
            pooled[5] = *std::min_element(exposed_.begin(), exposed_.end());
        }
        ready_.clear();
        exposed_.clear();
        durations_.clear();
        launch_.clear();
        if (backend.size() > 1) backend.allreduce(Buffer{pooled.data(), pooled.size(), DType::float64}, ReduceOp::sum);
        if (pooled[0] == 0) {
            if (++idle_ >= idle_decisions) active_ = false;
            return std::nullopt;
        }
        for (std::size_t k = 1; k < pooled.size(); ++k) pooled[k] /= pooled[0];

        // Rank 0 decides: [changed, cap, first cap, exposure before, after, cost (4), order...]
        constexpr std::size_t decided = 9;
        std::vector<double> decision(decided + n, 0.0);
        if (backend.rank() == 0) {
            const CollectiveCost fitted{pooled[1], pooled[2], pooled[3], pooled[4]};
            // As backward alone would run them: each plan's own launches stall it anew.
            const auto ready = without_launch_stalls(plan, std::span<const double>(pooled).subspan(head, n), fitted);
            const auto cost = fitted_to_exposure(plan, ready, fitted, pooled[5]);
            const auto order = readiness_order_of(ready);
            const auto tuned = tune_caps(current, params, order, ready, cost);
            decision = {tuned.plan == plan ? 0.0 : 1.0,
                        static_cast<double>(tuned.bucketer.cap.count()),
                        static_cast<double>(tuned.bucketer.first_cap.count()),
                        predicted_exposure(plan, ready, cost),
                        tuned.exposure,
                        cost.latency,
                        cost.per_byte,
                        cost.launch,
                        cost.stall};
            for (auto p : order) decision.push_back(static_cast<double>(p));
        }
        if (backend.size() > 1) backend.broadcast(std::as_writable_bytes(std::span<double>(decision)), 0);
        if (++round_ >= rounds) active_ = false;
        warmed_up_ = false;
        if (decision[0] == 0) return std::nullopt;
        Choice<B> choice{current,  {}, decision[3], decision[4], {decision[5], decision[6], decision[7], decision[8]},
                         pooled[5]};
        choice.bucketer.cap = Bytes{static_cast<std::uint64_t>(decision[1])};
        choice.bucketer.first_cap = Bytes{static_cast<std::uint64_t>(decision[2])};
        std::vector<std::size_t> order;
        for (std::size_t k = 0; k < n; ++k) order.push_back(static_cast<std::size_t>(decision[decided + k]));
        choice.plan = choice.bucketer.plan(params, order);
        return choice;
    }

private:
    // The share of a launch that lengthened backward, from this round (under `plan`, with median
    // ready times `ready` and launches of `launch` seconds) and the one before, under another plan
    // (bucket/tuning.hpp, launch_stall). 0 in the first round. Remembers this round for the next.
    double stall_since_last_round(const BucketPlan& plan, std::span<const double> ready, double launch) {
        double end = 0;
        for (double r : ready) end = std::max(end, r);
        const auto launches = LaunchCount(completion_times(plan, ready)).before(end);
        const double stall =
            last_round_ ? launch_stall(last_round_->end, last_round_->launches, end, launches, launch) : 0.0;
        last_round_ = Round{end, launches};
        return stall;
    }

    // Parameters by the time they were ready; ties in reverse registration order.
    static std::vector<std::size_t> readiness_order_of(std::span<const double> ready) {
        std::vector<std::size_t> order(ready.size());
        std::iota(order.rbegin(), order.rend(), std::size_t{0});
        std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return ready[a] < ready[b]; });
        return order;
    }

    static double median(std::vector<double> v) {
        const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
        std::nth_element(v.begin(), mid, v.end());
        return *mid;
    }

    [[nodiscard]] double median_ready(std::size_t p) const {
        std::vector<double> v;
        for (const auto& step : ready_) v.push_back(step[p]);
        return median(std::move(v));
    }

    // One sample per bucket: the median of its collective's durations over the measured steps.
    // The median, not the shortest: what a step meets is the collective slowed by what runs beside
    // it (the launches and the backward of its own step, on a host whose cores it shares) and by
    // the wait for the last rank to launch it, which the mean ready times pooled from the ranks do
    // not show. The shortest made a collective look up to 15 us cheaper, which a plan of 90
    // buckets paid in full after backward.
    [[nodiscard]] std::vector<CollectiveSample> bucket_samples(const BucketPlan& plan) const {
        std::vector<CollectiveSample> out;
        for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
            std::vector<double> seconds;
            for (const auto& step : durations_)
                if (b < step.size()) seconds.push_back(step[b]);
            if (!seconds.empty()) out.push_back({plan.buckets[b].bytes(), median(std::move(seconds))});
        }
        return out;
    }

    bool active_ = false;
    bool warmed_up_ = false;
    int steps_ = 0, round_ = 0, idle_ = 0;
    std::vector<std::vector<double>> ready_;      // per measured step, per parameter
    std::vector<std::vector<double>> durations_;  // per measured step, per bucket
    std::vector<double> launch_;                  // per measured step, the mean launch
    std::vector<double> exposed_;                 // per measured step, seconds after backward
    std::vector<CollectiveSample> samples_;       // per bucket of every round so far
    struct Round {
        double end = 0;            // backward's length (the last median ready time), seconds
        std::size_t launches = 0;  // buckets launched in it
    };
    std::optional<Round> last_round_;  // the last round that measured
    double launch_seconds_ = 0;        // this step's launches so far
    std::size_t launches_ = 0;
};

}  // namespace gradsync::inline v0::detail
