// Bucket planning: properties that every plan must have, checked on randomized layouts, and
// the exact plans for layouts small enough to work out by hand.
#include <gradsync/bucket/bucketers.hpp>

#include <doctest/doctest.h>

#include "model_layouts.hpp"

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

using namespace gradsync::literals;
using gradsync::BucketPlan;
using gradsync::DType;
using gradsync::Parameter;

namespace {

Parameter fake(std::size_t count, DType t = DType::float32, std::string name = "p") {
    return Parameter{std::move(name), nullptr, nullptr, count, t};
}

std::vector<Parameter> random_layout(std::mt19937_64& rng) {
    std::uniform_int_distribution<int> n_params(0, 60), kind(0, 9), dtype(0, 3);
    std::vector<Parameter> params;
    int n = n_params(rng);
    for (int i = 0; i < n; ++i) {
        std::size_t count = 0;
        switch (kind(rng)) {
            case 0: count = 0; break;                                                                    // skipped
            case 1: count = std::uniform_int_distribution<std::size_t>(1u << 18, 1u << 21)(rng); break;  // large
            default: count = std::uniform_int_distribution<std::size_t>(1, 20000)(rng);
        }
        params.push_back(fake(count, static_cast<DType>(dtype(rng)), "p" + std::to_string(i)));
    }
    return params;
}

// Properties every bucketer's plan has.
void check_common(const std::vector<Parameter>& params, const BucketPlan& plan) {
    std::vector<int> seen(params.size(), 0);
    for (const auto& b : plan.buckets) {
        REQUIRE_FALSE(b.parameters.empty());
        std::size_t count = 0;
        for (auto i : b.parameters) {
            REQUIRE(i < params.size());
            CHECK(params[i].dtype == b.dtype);  // one dtype per bucket
            count += params[i].count;
            ++seen[i];
        }
        CHECK(b.count == count);
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
        CHECK(seen[i] == (params[i].count == 0 ? 0 : 1));  // exactly once, zero-sized never
    }
    // Per dtype, the buckets in launch order concatenate to the reverse registration order.
    for (int t = 0; t < 4; ++t) {
        std::vector<std::size_t> expected, actual;
        for (std::size_t i = params.size(); i-- > 0;)
            if (params[i].count != 0 && static_cast<int>(params[i].dtype) == t) expected.push_back(i);
        for (const auto& b : plan.buckets)
            if (static_cast<int>(b.dtype) == t) actual.insert(actual.end(), b.parameters.begin(), b.parameters.end());
        CHECK(actual == expected);
    }
}

}  // namespace

TEST_CASE("every bucketer covers every parameter once, one dtype per bucket, in reverse order") {
    std::mt19937_64 rng(20261129);
    for (int trial = 0; trial < 300; ++trial) {
        auto params = random_layout(rng);
        CAPTURE(trial);
        check_common(params, gradsync::SizeCappedBuckets{}.plan(params));
        check_common(params, gradsync::SizeCappedBuckets{64_KiB, 8_KiB}.plan(params));
        check_common(params, gradsync::SizeCappedBuckets{.growing = true}.plan(params));
        check_common(params, gradsync::SizeCappedBuckets{64_KiB, 8_KiB, true}.plan(params));
        check_common(params, gradsync::SingleBucket{}.plan(params));
        check_common(params, gradsync::PerParameterBuckets{}.plan(params));
    }
}

TEST_CASE("size-capped buckets respect their caps and are filled greedily") {
    std::mt19937_64 rng(7);
    for (int trial = 0; trial < 300; ++trial) {
        auto params = random_layout(rng);
        const gradsync::SizeCappedBuckets policy{64_KiB, 8_KiB, /*growing=*/false};
        auto plan = policy.plan(params);
        CAPTURE(trial);
        // Walk each dtype's buckets: the first has first_cap, the others cap.
        for (int t = 0; t < 4; ++t) {
            std::vector<const gradsync::Bucket*> mine;
            for (const auto& b : plan.buckets)
                if (static_cast<int>(b.dtype) == t) mine.push_back(&b);
            for (std::size_t k = 0; k < mine.size(); ++k) {
                auto limit = k == 0 ? policy.first_cap : policy.cap;
                const auto& b = *mine[k];
                // Within the cap, unless a single parameter is larger than it.
                CHECK((b.bytes() <= limit || b.parameters.size() == 1));
                // Greedy: a bucket closed below its limit could not take its successor's first parameter.
                if (k + 1 < mine.size() && b.bytes() < limit) {
                    auto next = params[mine[k + 1]->parameters.front()].bytes();
                    CHECK(b.bytes() + next > limit);
                }
            }
        }
    }
}

TEST_CASE("a plan is a deterministic function of the layout and the policy") {
    std::mt19937_64 rng(99);
    auto params = random_layout(rng);
    auto again = params;
    for (auto& p : again) {  // other names and pointers, same layout
        p.name += "_copy";
        p.data = &p;
    }
    gradsync::SizeCappedBuckets policy{32_KiB, 4_KiB};
    CHECK(policy.plan(params) == policy.plan(again));
    CHECK(policy.plan(params).hash() == policy.plan(again).hash());
    CHECK(std::hash<BucketPlan>{}(policy.plan(params)) == std::hash<BucketPlan>{}(policy.plan(again)));
    if (!params.empty()) {
        again.back().count += 1;
        if (params.back().count != 0) CHECK(policy.plan(params).hash() != policy.plan(again).hash());
    }
}

TEST_CASE("size-capped plan worked out by hand") {
    // Registration order: a 40 KiB, b 40 KiB, c 100 KiB, d 4 KiB, e 30 KiB (float32).
    std::vector<Parameter> params{fake(10240), fake(10240), fake(25600), fake(1024), fake(7680)};
    auto plan = gradsync::SizeCappedBuckets{64_KiB, 32_KiB, /*growing=*/false}.plan(params);
    // Reverse order e, d, c, b, a. First cap 32 KiB: e (30) + d (4) > 32 closes {e} first.
    // Then {d}; c (100 KiB) would overflow 64 KiB, so {d} closes and c stands alone.
    // Then b (40) + a (40) > 64: {b}, {a}.
    REQUIRE(plan.buckets.size() == 5);
    CHECK(plan.buckets[0].parameters == std::vector<std::size_t>{4});
    CHECK(plan.buckets[1].parameters == std::vector<std::size_t>{3});
    CHECK(plan.buckets[2].parameters == std::vector<std::size_t>{2});
    CHECK(plan.buckets[3].parameters == std::vector<std::size_t>{1});
    CHECK(plan.buckets[4].parameters == std::vector<std::size_t>{0});

    // A bucket that reaches its cap exactly closes at once.
    std::vector<Parameter> exact{fake(4096), fake(4096), fake(4096), fake(4096)};  // 16 KiB each
    auto p2 = gradsync::SizeCappedBuckets{32_KiB, 16_KiB, /*growing=*/false}.plan(exact);
    REQUIRE(p2.buckets.size() == 3);
    CHECK(p2.buckets[0].parameters == std::vector<std::size_t>{3});     // 16 KiB == first cap
    CHECK(p2.buckets[1].parameters == std::vector<std::size_t>{2, 1});  // 32 KiB == cap
    CHECK(p2.buckets[2].parameters == std::vector<std::size_t>{0});
}

TEST_CASE("mixed dtypes get buckets of their own") {
    std::vector<Parameter> params{fake(10, DType::float32), fake(10, DType::float64), fake(10, DType::float32),
                                  fake(0, DType::float64)};
    auto plan = gradsync::SingleBucket{}.plan(params);
    REQUIRE(plan.buckets.size() == 2);
    CHECK(plan.buckets[0].dtype == DType::float32);
    CHECK(plan.buckets[0].parameters == std::vector<std::size_t>{2, 0});
    CHECK(plan.buckets[0].bytes() == 80_B);
    CHECK(plan.buckets[1].dtype == DType::float64);
    CHECK(plan.buckets[1].parameters == std::vector<std::size_t>{1});

    auto per = gradsync::PerParameterBuckets{}.plan(params);
    REQUIRE(per.buckets.size() == 3);
    CHECK(per.buckets[0].parameters == std::vector<std::size_t>{2});
}

TEST_CASE("the default plan of ResNet-50 starts small and caps at 25 MiB") {
    auto tensors = layouts::resnet50();
    REQUIRE(tensors.size() == 161);
    REQUIRE(layouts::total_count(tensors) == 25557032);
    std::vector<Parameter> params;
    for (const auto& t : tensors) params.push_back(fake(t.count, DType::float32, t.name));
    auto plan = gradsync::SizeCappedBuckets{}.plan(params);
    CHECK(plan.bytes() == gradsync::Bytes{25557032ull * 4});
    REQUIRE(plan.buckets.size() >= 4);
    CHECK(plan.buckets[0].parameters.front() == 160);  // fc.bias is ready first
    CHECK(plan.buckets[0].bytes() <= 1_MiB);
    for (const auto& b : plan.buckets) CHECK((b.bytes() <= 25_MiB || b.parameters.size() == 1));
    auto text = gradsync::to_string(plan);
    CHECK(text.find(std::to_string(plan.buckets.size()) + " buckets, 97.5 MiB") == 0);
    CHECK(text.find("[0] float32") != std::string::npos);

    auto bert = layouts::bert_base();
    CHECK(bert.size() == 199);
    CHECK(layouts::total_count(bert) == 109482240);
}

TEST_CASE("a size-capped bucketer without a cap is an error") {
    std::vector<Parameter> params{fake(4)};
    CHECK_THROWS_WITH_AS(gradsync::SizeCappedBuckets({0_B, 1_MiB}).plan(params),
                         doctest::Contains("needs a cap and a first_cap above 0 bytes"), gradsync::Error);
}

TEST_CASE("growing buckets are filled to the cap from the last one back, the first at most first_cap") {
    std::mt19937_64 rng(20261203);
    for (int trial = 0; trial < 300; ++trial) {
        auto params = random_layout(rng);
        CAPTURE(trial);
        const gradsync::SizeCappedBuckets policy{64_KiB, 8_KiB, true};
        const auto plan = policy.plan(params);
        // Launch order: each bucket completes before the next (its last parameter, registered
        // later, is ready earlier).
        for (std::size_t k = 1; k < plan.buckets.size(); ++k)
            CHECK(plan.buckets[k - 1].parameters.back() > plan.buckets[k].parameters.back());
        for (int t = 0; t < 4; ++t) {
            std::vector<const gradsync::Bucket*> mine;
            for (const auto& b : plan.buckets)
                if (static_cast<int>(b.dtype) == t) mine.push_back(&b);
            for (std::size_t k = 0; k < mine.size(); ++k) {
                const auto& b = *mine[k];
                CHECK((b.bytes() <= 64_KiB || b.parameters.size() == 1));
                if (k == 0) {
                    if (mine.size() > 1 || b.parameters.size() > 1)
                        CHECK((b.bytes() <= 8_KiB || b.parameters.size() == 1));
                    continue;
                }
                // Every bucket but the dtype's first two (the first and what is left beside it) is
                // full: the parameter ready just before it would have pushed it over the cap.
                if (k >= 2) {
                    const auto& before = *mine[k - 1];
                    CHECK(b.bytes() + params[before.parameters.back()].bytes() > 64_KiB);
                }
            }
        }
    }
}

TEST_CASE("growing buckets on ResNet-50 end with the largest, and say so in their settings") {
    std::vector<Parameter> params;
    for (const auto& t : layouts::resnet50()) params.push_back(fake(t.count, DType::float32, t.name));
    const gradsync::SizeCappedBuckets growing{.cap = 25_MiB};
    const auto plan = growing.plan(params);
    const gradsync::SizeCappedBuckets ddp{.cap = 25_MiB, .growing = false};  // PyTorch DDP's plan
    const auto forward = ddp.plan(params);
    REQUIRE(plan.buckets.size() >= 4);
    CHECK(plan.bytes() == forward.bytes());
    CHECK(plan.buckets[0].parameters.front() == 160);  // fc.bias is ready first, as without
    CHECK(plan.buckets[0].bytes() <= 1_MiB);
    for (const auto& b : plan.buckets) CHECK(b.bytes() <= plan.buckets.back().bytes());
    CHECK(plan.buckets.back().parameters.back() == 0);  // conv1, ready last
    // Filled forward, DDP's plan ends with a bucket smaller than the one before it.
    CHECK(forward.buckets.back().bytes() < forward.buckets[forward.buckets.size() - 2].bytes());
    CHECK(ddp.settings() == "size-capped, cap 25 MiB, first cap 1 MiB, filled forward");
    CHECK(growing.settings() == "size-capped, cap 25 MiB, first cap 1 MiB, growing along backward");
}

TEST_CASE("the default plan grows along backward, but by a parameter larger than its cap") {
    for (const auto& layout : {layouts::resnet50(), layouts::bert_base()}) {
        std::vector<Parameter> params;
        for (const auto& t : layout) params.push_back(fake(t.count, DType::float32, t.name));
        const gradsync::SizeCappedBuckets defaults;
        CHECK(defaults.settings() == "size-capped, cap 8 MiB, first cap 1 MiB, growing along backward");
        const auto plan = defaults.plan(params);
        CAPTURE(plan.buckets.size());
        // A bucket is never larger than the next one and the last-ready parameter it closed on;
        // a parameter larger than the cap has a bucket of its own (a view where the gradients
        // must travel contiguously: no copy).
        for (std::size_t k = 1; k + 1 < plan.buckets.size(); ++k) {
            const auto& b = plan.buckets[k];
            CHECK(b.bytes() <= plan.buckets[k + 1].bytes() + params[b.parameters.back()].bytes());
            CHECK((b.bytes() <= 8_MiB || b.parameters.size() == 1));
        }
        CHECK(plan.buckets.back().parameters.back() == 0);  // the first parameter is ready last
    }
}
