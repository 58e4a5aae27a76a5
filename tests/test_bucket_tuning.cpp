// Bucket tuning's arithmetic: the cost fit, the exposure a plan leaves, and the caps chosen for
// layouts and timings whose best plan is known.
#include <gradsync/bucket/tuning.hpp>

#include <doctest/doctest.h>

#include "model_layouts.hpp"

#include <cmath>
#include <cstddef>
#include <vector>

using namespace gradsync::literals;
using gradsync::CollectiveCost;
using gradsync::CollectiveSample;
using gradsync::DType;
using gradsync::Parameter;
using gradsync::SizeCappedBuckets;

namespace {

std::vector<Parameter> resnet50() {
    std::vector<Parameter> out;
    for (const auto& t : layouts::resnet50())
        out.push_back(Parameter{t.name, nullptr, nullptr, t.count, DType::float32});
    return out;
}

// Backward over `seconds`, each parameter ready when its share (by size) of the compute is done,
// in reverse registration order: as the overlap benchmark models it.
std::vector<double> uniform_backward(const std::vector<Parameter>& params, double seconds) {
    double total = 0, done = 0;
    for (const auto& p : params) total += static_cast<double>(p.count);
    std::vector<double> ready(params.size());
    for (std::size_t i = params.size(); i-- > 0;) {
        done += static_cast<double>(params[i].count);
        ready[i] = seconds * done / total;
    }
    return ready;
}

}  // namespace

TEST_CASE("fit_cost recovers latency and bandwidth from collectives of several sizes") {
    const CollectiveCost truth{20e-6, 0.25e-9};
    std::vector<CollectiveSample> samples;
    for (auto bytes : {1_MiB, 4_MiB, 25_MiB, 25_MiB, 7_MiB}) samples.push_back({bytes, truth.of(bytes)});
    const auto fit = gradsync::fit_cost(samples);
    CHECK(fit.latency == doctest::Approx(truth.latency).epsilon(1e-6));
    CHECK(fit.per_byte == doctest::Approx(truth.per_byte).epsilon(1e-9));

    // One size: latency and bandwidth cannot be told apart; it all counts as bandwidth.
    const std::vector<CollectiveSample> same{{4_MiB, 0.002}, {4_MiB, 0.004}};
    const auto flat = gradsync::fit_cost(same);
    CHECK(flat.latency == 0);
    CHECK(flat.per_byte == doctest::Approx(0.003 / double((4_MiB).count())));

    // Noise that makes larger collectives look faster never yields a negative cost.
    const std::vector<CollectiveSample> noisy{{1_MiB, 0.003}, {8_MiB, 0.001}};
    const auto clamped = gradsync::fit_cost(noisy);
    CHECK(clamped.per_byte == 0);
    CHECK(clamped.latency == doctest::Approx(0.002));
    CHECK(gradsync::fit_cost({}).of(1_MiB) == 0);
}

TEST_CASE("predicted_exposure: collectives in plan order, each after its bucket and its predecessor") {
    const std::vector<Parameter> params{{"a", nullptr, nullptr, 1000, DType::float32},
                                        {"b", nullptr, nullptr, 1000, DType::float32},
                                        {"c", nullptr, nullptr, 1000, DType::float32}};
    gradsync::BucketPlan plan;
    plan.buckets.push_back({DType::float32, {2}, 1000});
    plan.buckets.push_back({DType::float32, {1, 0}, 2000});
    const std::vector<double> ready{3.0, 2.0, 1.0};  // seconds; backward ends at 3
    const CollectiveCost cost{0.5, 1.0 / 4000};      // 4000 bytes: 1.5 s, 8000 bytes: 2.5 s
    // bucket 0: ready at 1, done at 2.5; bucket 1: ready at 3, done at 5.5: 2.5 s after backward.
    CHECK(gradsync::predicted_exposure(plan, ready, cost) == doctest::Approx(2.5));
    // A slow first collective delays the second even when its bucket is ready earlier.
    const std::vector<double> early{0.5, 0.5, 0.0};
    CHECK(gradsync::predicted_exposure(plan, early, CollectiveCost{2.0, 0}) == doctest::Approx(3.5));
}

TEST_CASE("tune_caps splits ResNet-50 finer than 25 MiB when backward takes twice the communication") {
    const auto params = resnet50();
    const CollectiveCost cost{20e-6, 1.0 / 6e9};  // 6 GB/s: about 17 ms for the 97.5 MiB
    const auto ready = uniform_backward(params, 0.034);
    const SizeCappedBuckets standard{};
    const auto tuned = gradsync::tune_caps(standard, params, {}, ready, cost);
    const double before = gradsync::predicted_exposure(standard.plan(params), ready, cost);
    MESSAGE("default caps: ", before * 1e3, " ms exposed; tuned (cap ", to_string(tuned.bucketer.cap), ", first ",
            to_string(tuned.bucketer.first_cap), ", ", tuned.plan.buckets.size(), " buckets): ", tuned.exposure * 1e3,
            " ms");
    CHECK(tuned.bucketer.cap < standard.cap);
    CHECK(tuned.exposure < before / 3);
    CHECK(tuned.plan == tuned.bucketer.plan(params));
    CHECK(tuned.exposure == doctest::Approx(gradsync::predicted_exposure(tuned.plan, ready, cost)));
}

TEST_CASE("tune_caps takes one bucket when there is nothing to overlap or collectives cost mostly latency") {
    const auto params = resnet50();
    const SizeCappedBuckets standard{};
    // Every gradient ready at once: splitting only adds latencies.
    const std::vector<double> at_once(params.size(), 0.0);
    auto tuned = gradsync::tune_caps(standard, params, {}, at_once, CollectiveCost{50e-6, 1.0 / 6e9});
    CHECK(tuned.plan.buckets.size() == 1);
    // A collective costs a second whatever its size, backward a millisecond.
    tuned = gradsync::tune_caps(standard, params, {}, uniform_backward(params, 1e-3), CollectiveCost{1.0, 1e-15});
    CHECK(tuned.plan.buckets.size() == 1);
}

TEST_CASE("tune_caps keeps the current caps when no plan is better") {
    const std::vector<Parameter> params{{"a", nullptr, nullptr, 100, DType::float32},
                                        {"b", nullptr, nullptr, 100, DType::float32}};
    const SizeCappedBuckets current{64_KiB, 64_KiB};  // one bucket: the fewest there can be
    const auto tuned = gradsync::tune_caps(current, params, {}, std::vector<double>{0.0, 0.0}, CollectiveCost{});
    CHECK(tuned.bucketer.cap == current.cap);
    CHECK(tuned.bucketer.first_cap == current.first_cap);
}

TEST_CASE("launches that stall backward count as exposed, and measured ready times shed the stalls") {
    const std::vector<Parameter> params{{"a", nullptr, nullptr, 1000, DType::float32},
                                        {"b", nullptr, nullptr, 1000, DType::float32},
                                        {"c", nullptr, nullptr, 1000, DType::float32}};
    gradsync::BucketPlan per_parameter;
    for (std::size_t p = 3; p-- > 0;) per_parameter.buckets.push_back({DType::float32, {p}, 1000});
    const std::vector<double> ready{3.0, 2.0, 1.0};  // backward alone: c at 1, b at 2, a at 3
    // Free collectives, launches of 0.25 s. Backward does not wait for them: only the last
    // launch, at the end, is exposed.
    CollectiveCost cost{0, 0, 0.25, 0};
    CHECK(gradsync::predicted_exposure(per_parameter, ready, cost) == doctest::Approx(0.25));
    // Backward runs on the launching thread: the launches at 1 and 2 push the end to 3.5, and the
    // last one goes after it.
    cost.stall = 1;
    CHECK(gradsync::predicted_exposure(per_parameter, ready, cost) == doctest::Approx(0.75));
    // Times measured under that plan carry its stalls (b at 2.25, a at 3.5); shed, they are
    // backward's own again.
    const std::vector<double> measured{3.5, 2.25, 1.0};
    const auto own = gradsync::without_launch_stalls(per_parameter, measured, cost);
    CHECK(own[0] == doctest::Approx(3.0));
    CHECK(own[1] == doctest::Approx(2.0));
    CHECK(own[2] == doctest::Approx(1.0));
    cost.stall = 0;
    CHECK(gradsync::without_launch_stalls(per_parameter, measured, cost) == measured);
}

TEST_CASE("LaunchCount counts the buckets complete strictly before a time, in any plan order") {
    // Plan order need not be completion order (a bucket filled forward completes last).
    const gradsync::LaunchCount launches({3.0, 1.0, 2.0, 1.0});
    CHECK(launches.before(0.5) == 0);
    CHECK(launches.before(1.0) == 0);  // a bucket completing at t is launched at t, not before
    CHECK(launches.before(1.5) == 2);
    CHECK(launches.before(2.0) == 2);
    CHECK(launches.before(2.5) == 3);
    CHECK(launches.before(9.0) == 4);
    CHECK(gradsync::LaunchCount({}).before(1.0) == 0);
}

TEST_CASE("launch_stall: how much of a launch lengthened backward, from two plans measured in turn") {
    // 10 more launches of 1 ms made backward 10 ms longer: every launch stalled it.
    CHECK(gradsync::launch_stall(0.100, 5, 0.110, 15, 1e-3) == doctest::Approx(1.0));
    // Half of it: a backward that waited on something else half of the time.
    CHECK(gradsync::launch_stall(0.100, 15, 0.095, 5, 1e-3) == doctest::Approx(0.5));
    // Unchanged (a GPU computing, or a backward that sleeps to its deadlines).
    CHECK(gradsync::launch_stall(0.100, 5, 0.100, 15, 1e-3) == 0);
    // Noise is clamped into [0, 1].
    CHECK(gradsync::launch_stall(0.100, 5, 0.130, 15, 1e-3) == 1);
    CHECK(gradsync::launch_stall(0.100, 5, 0.090, 15, 1e-3) == 0);
    // Launches that differ by less than a millisecond (or 5 % of backward) tell nothing.
    CHECK(gradsync::launch_stall(0.100, 5, 0.1009, 14, 1e-4) == 0);
    CHECK(gradsync::launch_stall(1.0, 5, 1.02, 25, 1e-3) == 0);
}

TEST_CASE("tune_caps takes fewer buckets for ResNet-50 when every launch stalls backward") {
    const auto params = resnet50();
    const auto ready = uniform_backward(params, 0.034);
    const SizeCappedBuckets standard{};
    CollectiveCost cost{20e-6, 1.0 / 6e9, 200e-6, 0};  // launches of 200 us (a slow model listing)
    const auto hidden = gradsync::tune_caps(standard, params, {}, ready, cost);
    cost.stall = 1;
    const auto stalling = gradsync::tune_caps(standard, params, {}, ready, cost);
    MESSAGE("launches hidden: ", hidden.plan.buckets.size(), " buckets, ", hidden.exposure * 1e3,
            " ms; stalling backward: ", stalling.plan.buckets.size(), " buckets, ", stalling.exposure * 1e3, " ms");
    CHECK(stalling.plan.buckets.size() < hidden.plan.buckets.size());
    // What the stalls cost the plan chosen without them is counted now, and more than the choice.
    CHECK(gradsync::predicted_exposure(hidden.plan, ready, cost) > stalling.exposure);
}

TEST_CASE("fitted_to_exposure charges each collective what the replay missed, and a finer plan pays it") {
    const auto params = resnet50();
    const CollectiveCost fitted{5e-6, 1.0 / 12e9};  // 12 GB/s: about 8.5 ms for the 97.5 MiB
    const auto ready = uniform_backward(params, 0.017);
    const SizeCappedBuckets fine{.cap = 256_KiB, .first_cap = 64_KiB};
    const auto plan = fine.plan(params);
    const double replayed = gradsync::predicted_exposure(plan, ready, fitted);
    // Less measured than replayed (or as much): the cost stays as fitted, never lowered.
    CHECK(gradsync::fitted_to_exposure(plan, ready, fitted, replayed / 2).latency == fitted.latency);
    CHECK(gradsync::fitted_to_exposure(plan, ready, fitted, replayed).latency == fitted.latency);
    // More measured: the latency rises until the replay exposes what was measured.
    const double measured = replayed + 0.6e-3;
    const auto raised = gradsync::fitted_to_exposure(plan, ready, fitted, measured);
    CHECK(raised.latency > fitted.latency);
    CHECK(raised.per_byte == fitted.per_byte);
    CHECK(gradsync::predicted_exposure(plan, ready, raised) == doctest::Approx(measured).epsilon(1e-6));
    // Tuned with what the steps met, the plan has fewer buckets than with the samples alone.
    const SizeCappedBuckets standard{};
    const auto naive = gradsync::tune_caps(standard, params, {}, ready, fitted);
    const auto met = gradsync::tune_caps(standard, params, {}, ready, raised);
    MESSAGE("tuned from the samples: ", naive.plan.buckets.size(), " buckets; from the exposure measured under ",
            plan.buckets.size(), ": ", met.plan.buckets.size(), " (", raised.latency * 1e6, " us per collective)");
    CHECK(met.plan.buckets.size() < naive.plan.buckets.size());
    CHECK(met.plan.buckets.size() < plan.buckets.size());
}
