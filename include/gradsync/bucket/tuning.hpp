// Bucket tuning, the arithmetic: from when each gradient became ready in backward and what a
// collective costs, predict how much communication a plan leaves exposed after backward, and
// choose the caps of a size-capped bucketer that expose the least. Pure functions: the same
// inputs give the same plan on every rank.
#pragma once

#include <gradsync/bucket/bucketers.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::max, std::min, std::sort, std::lower_bound, std::clamp
#include <cmath>      // for std::abs
#include <concepts>   // for std::same_as
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0 {

// A bucketer whose plan is set by two caps, as SizeCappedBuckets: the ones tuning can choose.
template <class B>
concept TunableBucketer = Bucketer<B> && std::copyable<B> && requires(B b) {
    { b.cap } -> std::same_as<Bytes&>;
    { b.first_cap } -> std::same_as<Bytes&>;
};

// The time of one collective as latency + bytes x seconds per byte, and what launching one costs
// the thread that runs backward (the host's share: listing, packing, queueing). `stall`: the share
// of a launch that lengthens backward, 0 where backward does not wait for that thread (a GPU
// computes while the host runs ahead), 1 where backward runs on it (a CPU-bound backward).
struct CollectiveCost {
    double latency = 0;   // seconds
    double per_byte = 0;  // seconds
    double launch = 0;    // seconds of the launching thread per bucket
    double stall = 0;     // 0 to 1

    [[nodiscard]] double of(Bytes bytes) const { return latency + per_byte * static_cast<double>(bytes.count()); }
};

// One measured collective: its bytes and the seconds from its start (launch, or its
// predecessor's end when it had to queue) to its end.
struct CollectiveSample {
    Bytes bytes;
    double seconds = 0;
};

// Least squares over the samples, neither term below 0. Samples of one size cannot separate
// latency from bandwidth: then all of it counts as bandwidth.
inline CollectiveCost fit_cost(std::span<const CollectiveSample> samples) {
    if (samples.empty()) return {};
    double n = 0, sx = 0, sy = 0, min_x = 0, max_x = 0;
    for (const auto& s : samples) {
        const double x = static_cast<double>(s.bytes.count());
        min_x = n == 0 ? x : std::min(min_x, x);
        max_x = std::max(max_x, x);
        n += 1;
        sx += x;
        sy += s.seconds;
    }
    const double mx = sx / n, my = sy / n;
    double sxx = 0, sxy = 0;
    for (const auto& s : samples) {
        const double dx = static_cast<double>(s.bytes.count()) - mx;
        sxx += dx * dx;
        sxy += dx * (s.seconds - my);
    }
    CollectiveCost cost;
    if (max_x < 2 * min_x || sxx <= 0) {
        cost.per_byte = sx > 0 ? std::max(0.0, sy / sx) : 0;
        return cost;
    }
    cost.per_byte = std::max(0.0, sxy / sxx);
    cost.latency = std::max(0.0, my - cost.per_byte * mx);
    return cost;
}

// When each bucket of `plan` is complete: the ready time of its last parameter.
inline std::vector<double> completion_times(const BucketPlan& plan, std::span<const double> ready) {
    std::vector<double> out;
    for (const auto& bucket : plan.buckets) {
        double complete = 0;
        for (auto p : bucket.parameters) complete = std::max(complete, ready[p]);
        out.push_back(complete);
    }
    return out;
}

// How many of a plan's buckets complete before a given time: the launches backward has made by
// then. Sorted once, so that a replay asks it once per bucket in logarithmic time.
class LaunchCount {
public:
    explicit LaunchCount(std::vector<double> completions) : sorted_(std::move(completions)) {
        std::sort(sorted_.begin(), sorted_.end());
    }
    [[nodiscard]] std::size_t before(double t) const {
        return static_cast<std::size_t>(std::lower_bound(sorted_.begin(), sorted_.end(), t) - sorted_.begin());
    }

private:
    std::vector<double> sorted_;
};

// Ready times without the stalls that the launches of `plan` (under which they were measured) put
// into backward: what backward alone would take, as any other plan's launches would shift it.
inline std::vector<double> without_launch_stalls(const BucketPlan& plan, std::span<const double> ready,
                                                 const CollectiveCost& cost) {
    std::vector<double> out(ready.begin(), ready.end());
    if (cost.stall <= 0) return out;
    const LaunchCount launches(completion_times(plan, ready));
    for (auto& r : out) r -= cost.stall * cost.launch * static_cast<double>(launches.before(r));
    return out;
}

// The communication `plan` leaves after backward, in seconds, if parameter p is ready at
// ready[p] (seconds into backward, which ends with the last of them; without launch stalls):
// buckets are launched one at a time in plan order, each once complete (taking cost.launch of the
// launching thread), and their collectives run one at a time, each once launched and its
// predecessor done. A launch in backward also delays, by cost.stall of it, all backward does
// after it: what a plan's launches lengthen backward by counts as exposed too.
inline double predicted_exposure(const BucketPlan& plan, std::span<const double> ready, const CollectiveCost& cost) {
    double end_of_backward = 0, launched = 0, done = 0;
    for (double r : ready) end_of_backward = std::max(end_of_backward, r);
    const auto completions = completion_times(plan, ready);
    const LaunchCount launches(completions);
    const double stall = cost.stall * cost.launch;
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
        const double complete = completions[b] + stall * static_cast<double>(launches.before(completions[b]));
        launched = std::max(launched, complete) + cost.launch;
        done = std::max(done, launched) + cost.of(plan.buckets[b].bytes());
    }
    const double lengthened = end_of_backward + stall * static_cast<double>(launches.before(end_of_backward));
    return std::max(done, lengthened) - end_of_backward;
}

// The cost with its latency raised until the replay of `plan` exposes `measured`, what steps under
// it left after backward: what the collectives met beside backward (a host's cores shared with
// backward and its launches, peers that launch later) and the samples of each alone do not show.
// Charged per collective, since that is what a finer plan multiplies. Never lowered: a plan that
// exposed less than its replay leaves the cost as fitted.
inline CollectiveCost fitted_to_exposure(const BucketPlan& plan, std::span<const double> ready, CollectiveCost cost,
                                         double measured) {
    if (plan.buckets.empty() || !(measured > predicted_exposure(plan, ready, cost))) return cost;
    // With `measured` more per collective, the bucket completed last alone exposes at least that.
    double below = 0, above = measured;
    for (int k = 0; k < 40; ++k) {
        CollectiveCost c = cost;
        c.latency += (below + above) / 2;
        (predicted_exposure(plan, ready, c) < measured ? below : above) = (below + above) / 2;
    }
    cost.latency += above;
    return cost;
}

// The share of a launch that lengthened backward, from two plans measured in turn: backward's
// length (the last ready time) and the launches made in it under each. 0 when backward did not
// grow with the launches (or they differ too little to tell: by less than a millisecond and 5 %
// of backward); at most 1.
inline double launch_stall(double end_a, std::size_t launches_a, double end_b, std::size_t launches_b, double launch) {
    const double extra = (static_cast<double>(launches_b) - static_cast<double>(launches_a)) * launch;
    if (std::abs(extra) < std::max(1e-3, 0.05 * std::min(end_a, end_b))) return 0;
    return std::clamp((end_b - end_a) / extra, 0.0, 1.0);
}

// What tuning chose, and what it expects.
template <TunableBucketer B>
struct TunedBuckets {
    B bucketer;
    BucketPlan plan;
    double exposure = 0;  // predicted, seconds
};

// The caps (powers of two from 64 KiB, and the current ones) whose plan exposes the least
// communication after backward. Among plans within 5% (and 10 us) of the best, the one with the
// fewest buckets wins (each costs the host a launch), then the current caps, so that noise alone
// does not change a plan.
template <TunableBucketer B>
TunedBuckets<B> tune_caps(const B& current, std::span<const Parameter> params, std::span<const std::size_t> order,
                          std::span<const double> ready, const CollectiveCost& cost) {
    Bytes total;
    for (const auto& p : params) total += p.bytes();
    std::vector<Bytes> sizes{current.cap, current.first_cap};
    for (std::uint64_t s = 64u << 10; s < 2 * std::max<std::uint64_t>(total.count(), 64u << 10); s *= 2)
        sizes.push_back(Bytes{s});
    std::sort(sizes.begin(), sizes.end());

    std::vector<TunedBuckets<B>> candidates;
    auto consider = [&](const B& b) {
        auto plan = b.plan(params, order);
        const double exposure = predicted_exposure(plan, ready, cost);
        candidates.push_back({b, std::move(plan), exposure});
    };
    consider(current);
    for (auto cap : sizes) {
        for (auto first : sizes) {
            if (first > cap || (cap == current.cap && first == current.first_cap)) continue;
            B b = current;
            b.cap = cap;
            b.first_cap = first;
            consider(b);
        }
    }
    double best = candidates.front().exposure;
    for (const auto& c : candidates) best = std::min(best, c.exposure);
    const double tolerance = 0.05 * best + 10e-6;
    const TunedBuckets<B>* chosen = nullptr;
    for (const auto& c : candidates) {  // the current caps first: kept on a tie
        if (c.exposure > best + tolerance) continue;
        if (chosen == nullptr || c.plan.buckets.size() < chosen->plan.buckets.size()) chosen = &c;
    }
    return *chosen;
}

}  // namespace gradsync::inline v0
