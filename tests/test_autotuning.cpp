// Bucket autotuning: what it chooses and when, on every rank alike; where it is on by default
// (wherever the plan cannot change a bit of the result) and where asking for it is refused.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "support/recording_backend.hpp"
#include "support/toy_model.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace gradsync::literals;
using gradsync::DataParallel;
using gradsync::LocalBackend;
using testing_support::expected_average;
using testing_support::RecordingBackend;
using testing_support::Toy;

namespace {

constexpr int steps_per_round = gradsync::detail::BucketTuner::steps_per_round;

// Steps of a backward that takes about 8 ms (16 layers of 256 KiB, the last first), each reported
// with grad_ready; the plan after each step. One bucket at first: all communication after backward,
// which tuning, where it is on, splits.
template <class Backend, class... Policies>
std::vector<gradsync::BucketPlan> sleepy_steps(Backend& b, int steps, Policies... policies) {
    Toy m(std::vector<std::size_t>(16, 64 * 1024), 0.0f);
    DataParallel dp(m, b, gradsync::SizeCappedBuckets{64_MiB, 64_MiB}, policies...);
    std::vector<gradsync::BucketPlan> plans;
    for (int s = 0; s < steps; ++s) {
        m.fill_grads(b.rank());
        for (std::size_t i = 16; i-- > 0;) {
            std::this_thread::sleep_for(std::chrono::microseconds(500));
            dp.grad_ready(i);
        }
        dp.synchronize();
        plans.push_back(dp.plan());
    }
    return plans;
}

// A bucket engine's slot as the tuner reads it: when its collective was launched and finished.
struct TimedSlot {
    std::chrono::steady_clock::time_point launched_at, finished_at;
};

// One tuning round of BucketTuner on one rank, under `plan`: steps_per_round steps whose
// parameters are ready at `ready` (seconds into backward), each launch taking `launch` seconds
// and collectives at 4 GB/s. Returns the round's choice.
template <class B>
std::optional<gradsync::detail::BucketTuner::Choice<B>> tuning_round(gradsync::detail::BucketTuner& tuner,
                                                                     LocalBackend& backend, const B& bucketer,
                                                                     const gradsync::BucketPlan& plan,
                                                                     const std::vector<gradsync::Parameter>& params,
                                                                     const std::vector<double>& ready, double launch) {
    // Collectives at 4 GB/s, one after the other from the start of backward.
    const auto began = std::chrono::steady_clock::now();
    auto at = began;
    std::vector<TimedSlot> slots;
    for (const auto& bucket : plan.buckets) {
        const auto took = std::chrono::nanoseconds(bucket.bytes().count() / 4);
        slots.push_back({at, at + took});
        at += took;
    }
    for (int s = 0; s < steps_per_round; ++s) {
        for (std::size_t k = 0; k < plan.buckets.size(); ++k) tuner.launch_took(launch);
        tuner.observe(ready, slots, began);
    }
    return tuner.choose(backend, bucketer, plan, params);
}

}  // namespace

TEST_CASE("bucket autotuning: from one bucket to a finer plan, the same on every rank, chosen at most twice") {
    const std::string timeline = "gradsync_test_autotune_timeline.json";
    std::remove(timeline.c_str());
    constexpr int steps = 12;
    std::vector<std::vector<gradsync::BucketPlan>> plans(2);  // per rank, after each step
    std::vector<int> wrong(2, 0);
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy m(std::vector<std::size_t>(16, 64 * 1024), 0.0f);  // 16 x 256 KiB
        // One bucket to begin with: all of the communication comes after backward.
        DataParallel dp(m, b, gradsync::SizeCappedBuckets{64_MiB, 64_MiB},
                        gradsync::Options{.autotune_buckets = true, .timeline = timeline});
        const auto r = static_cast<std::size_t>(b.rank());
        for (int s = 0; s < steps; ++s) {
            m.fill_grads(b.rank());
            for (std::size_t i = 16; i-- > 0;) {  // a backward of about 8 ms, last layer first
                std::this_thread::sleep_for(std::chrono::microseconds(500));
                dp.grad_ready(i);
            }
            dp.synchronize();
            plans[r].push_back(dp.plan());
            for (std::size_t k = 0; k < 16; ++k)
                for (std::size_t i = 0; i < m.tensors[k].g.size(); i += 97)
                    if (m.tensors[k].g[i] != expected_average<float>(2, k, i)) ++wrong[r];
        }
    });
    CHECK(wrong == std::vector<int>{0, 0});
    for (int s = 0; s < steps; ++s)
        CHECK(plans[0][static_cast<std::size_t>(s)] == plans[1][static_cast<std::size_t>(s)]);
    const auto per = static_cast<std::size_t>(steps_per_round);
    CHECK(plans[0][per - 2].buckets.size() == 1);  // before the first choice
    CHECK(plans[0][per - 1].buckets.size() > 1);   // the first choice splits it
    for (std::size_t s = 2 * per - 1; s < steps; ++s) CHECK(plans[0][s] == plans[0][2 * per - 1]);  // no third
    std::ifstream in(timeline);
    std::stringstream text;
    text << in.rdbuf();
    CHECK(text.str().find("\"name\":\"buckets tuned\"") != std::string::npos);
    CHECK(text.str().find("predicted exposed") != std::string::npos);
    std::remove(timeline.c_str());
}

TEST_CASE("asking for bucket autotuning where it cannot be is refused") {
    auto ranks = LocalBackend::create_group(1);
    Toy m({10, 20}, 0.0f);
    CHECK_THROWS_WITH_AS(
        DataParallel(m, ranks[0], gradsync::SingleBucket{}, gradsync::Options{.autotune_buckets = true}),
        doctest::Contains("Options::autotune_buckets chooses bucket caps, and this bucketer has none"),
        gradsync::Error);
}

TEST_CASE("bucket autotuning is on by default where the plan cannot change the result, off elsewhere") {
    const auto per = static_cast<std::size_t>(steps_per_round);
    SUBCASE("LocalBackend, no clipping, no wire compression: on") {
        gradsync::spawn(2, [&](LocalBackend& b) {
            const auto plans = sleepy_steps(b, steps_per_round);
            CHECK(plans[per - 2].buckets.size() == 1);
            CHECK(plans[per - 1].buckets.size() > 1);
        });
    }
    SUBCASE("with clipping (the norm is summed bucket by bucket): off") {
        gradsync::spawn(2, [&](LocalBackend& b) {
            const auto plans = sleepy_steps(b, 2 * steps_per_round, gradsync::Options{.clip_norm = 1e30});
            CHECK(plans.back().buckets.size() == 1);
        });
    }
    SUBCASE("with float16 on the wire (an overflowed bucket is redone alone): off") {
        gradsync::spawn(2, [&](LocalBackend& b) {
            const auto plans = sleepy_steps(b, 2 * steps_per_round, gradsync::Fp16Compression{});
            CHECK(plans.back().buckets.size() == 1);
        });
    }
    SUBCASE("a backend that does not promise sums in rank order: off, and on when asked") {
        // Tuning shows itself by pooling the ranks' measurements every few steps: an allreduce of
        // float64, one per parameter and a few more.
        auto pooled = [](const RecordingBackend& b) {
            return std::count_if(b.log.begin(), b.log.end(), [](const testing_support::Collective& c) {
                return c.kind == "allreduce" && c.dtype == gradsync::DType::float64 && c.count > 16;
            });
        };
        gradsync::spawn(2, [&](LocalBackend& inner) {
            RecordingBackend off(inner);
            const auto plans = sleepy_steps(off, 2 * steps_per_round);
            CHECK(plans.back().buckets.size() == 1);
            RecordingBackend on(inner);
            sleepy_steps(on, 2 * steps_per_round, gradsync::Options{.autotune_buckets = true});
            CHECK(pooled(on) - pooled(off) == 2);  // two rounds; the rest is the set-up's agreement
        });
    }
}

TEST_CASE("ranks that resolve autotuning differently are refused, naming the option") {
    std::vector<std::string> messages(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy m({1000, 2000}, 0.0f);
        try {
            // Rank 0 leaves it unset (on here), rank 1 turns it off.
            DataParallel dp(
                m, b, gradsync::Options{.autotune_buckets = b.rank() == 0 ? std::nullopt : std::optional<bool>(false)});
        } catch (const gradsync::Error& e) {
            messages[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& m : messages) CHECK(m.find("Options::autotune_buckets") != std::string::npos);
}

// The promise the default rests on: LocalBackend sums every element in rank order, so however the
// gradients are cut into buckets (and whether they travel packed or in place) the average is the
// same to the bit, with sums that round.
TEST_CASE("LocalBackend averages do not depend on the bucket plan, to the bit, on 3 and 5 ranks") {
    const std::vector<std::size_t> sizes{5, 3000, 1, 40000, 17, 256, 70000, 900};
    for (int world : {3, 5}) {
        CAPTURE(world);
        std::vector<std::vector<std::vector<float>>> results;  // per plan, per rank
        auto run = [&](auto... policies) {
            std::vector<std::vector<float>> per_rank(static_cast<std::size_t>(world));
            gradsync::spawn(world, [&](LocalBackend& b) {
                Toy m(sizes, 0.0f);
                DataParallel dp(m, b, policies..., gradsync::Options{.autotune_buckets = false});
                std::mt19937 rng(static_cast<unsigned>(b.rank()) * 7919u + 1u);
                std::uniform_real_distribution<float> d(-1.0f, 1.0f);
                for (auto& t : m.tensors)
                    for (auto& g : t.g) g = d(rng) * (1.0f + static_cast<float>(b.rank()) * 1000.0f);
                dp.synchronize();
                auto& out = per_rank[static_cast<std::size_t>(b.rank())];
                for (const auto& t : m.tensors) out.insert(out.end(), t.g.begin(), t.g.end());
            });
            results.push_back(std::move(per_rank));
        };
        run(gradsync::SingleBucket{});
        run(gradsync::PerParameterBuckets{});
        run(gradsync::SizeCappedBuckets{.cap = 64_KiB, .first_cap = 16_KiB});
        run(gradsync::SizeCappedBuckets{.cap = 64_KiB, .first_cap = 16_KiB}, gradsync::PackedBuckets{});
        run(gradsync::SizeCappedBuckets{.cap = 200_KiB, .growing = false}, gradsync::PackedBuckets{});
        const auto& first = results[0][0];
        for (std::size_t p = 0; p < results.size(); ++p)
            for (const auto& ranked : results[p]) {
                CAPTURE(p);
                REQUIRE(ranked.size() == first.size());
                CHECK(std::memcmp(ranked.data(), first.data(), first.size() * sizeof(float)) == 0);
            }
    }
}

TEST_CASE("bucket autotuning learns from two plans whether launches lengthen backward") {
    // 16 parameters of 256 KiB, ready every 2 ms in reverse order when backward runs alone.
    Toy m(std::vector<std::size_t>(16, 64 * 1024), 0.0f);
    const auto params = m.parameters();
    std::vector<double> alone(16);
    for (std::size_t i = 0; i < 16; ++i) alone[i] = 2e-3 * static_cast<double>(16 - i);
    const gradsync::SizeCappedBuckets one{64_MiB, 64_MiB}, each{256_KiB, 256_KiB};
    const auto single = one.plan(params), per_layer = each.plan(params);
    REQUIRE(per_layer.buckets.size() == 16);
    auto ranks = LocalBackend::create_group(1);
    // Under one bucket nothing launches in backward; under one per layer 15 launches of 1 ms do.
    // `stalled`: each of them lengthened backward by its millisecond.
    auto second_round = [&](bool stalled) {
        gradsync::detail::BucketTuner tuner(true);
        const auto first = tuning_round(tuner, ranks[0], one, single, params, alone, 1e-3);
        REQUIRE(first);
        CHECK(first->cost.stall == 0);  // one plan measured: nothing to compare yet
        std::vector<double> ready = alone;
        if (stalled)
            for (std::size_t i = 0; i < 16; ++i) ready[i] += 1e-3 * static_cast<double>(15 - i);
        return tuning_round(tuner, ranks[0], each, per_layer, params, ready, 1e-3);
    };
    // Where backward waited, the plan measured, one bucket per layer, stays (no new choice).
    CHECK(!second_round(false));
    const auto stalled = second_round(true);
    REQUIRE(stalled);
    CHECK(stalled->cost.stall == doctest::Approx(1.0));
    CHECK(stalled->summary().find("(100 % of it lengthening backward)") != std::string::npos);
    // Counting the stalls, 15 launches in backward cost more than they hide: fewer buckets.
    CHECK(stalled->plan.buckets.size() < per_layer.buckets.size());
    CHECK(stalled->exposure_before > stalled->exposure_after);
}
