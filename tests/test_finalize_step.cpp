// The finalize step: what the finalize pass measured becomes the norm and the finiteness of the
// step, the overflowing parameters are named, clipping scales down only when it must, and the
// step's decision runs the optimizer with the LR rule's rate only when every gradient is finite.
#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/backend/local.hpp>
#include <gradsync/data_parallel/finalize_step.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/lr.hpp>
#include <gradsync/memory/host.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

using gradsync::DType;
using gradsync::detail::BucketEngine;
using gradsync::detail::StepStats;

TEST_CASE("finalize step: the decision runs the optimizer with the rate only on finite gradients") {
    gradsync::DynamicLossScale scaler{.init_scale = 1024};
    gradsync::LinearLr lr{.base_lr = 0.1, .micro_batch = 8};
    double given = 0;
    int calls = 0;
    auto optimizer = [&](double rate) {
        given = rate;
        ++calls;
    };
    const auto name = [](std::size_t p) { return "p" + std::to_string(p); };
    auto report = gradsync::detail::decide_step(StepStats{.sum_squares = 9.0}, scaler, lr, 4, 1, optimizer, name, 0);
    CHECK(report.applied);
    CHECK(calls == 1);
    CHECK(given == doctest::Approx(0.4));  // linear: 0.1 x 4 ranks
    CHECK(report.learning_rate == given);
    CHECK(report.grad_norm == 3.0);
    CHECK(report.loss_scale == 1024.0f);
    CHECK(report.next_loss_scale == 1024.0f);

    StepStats overflow{.sum_squares = INFINITY, .nonfinite = {2, 5}};
    report = gradsync::detail::decide_step(overflow, scaler, lr, 4, 2, optimizer, name, 0);
    CHECK_FALSE(report.applied);
    CHECK(calls == 1);
    CHECK(report.overflowed == std::vector<std::string>{"p2", "p5"});
    CHECK(report.next_loss_scale == 512.0f);  // backed off
    CHECK(report.step == 2);

    gradsync::NoLossScaling none;
    gradsync::NoLrRule no_rule;
    int plain = 0;
    auto without_rate = [&] { ++plain; };
    report = gradsync::detail::decide_step(StepStats{}, none, no_rule, 2, 1, without_rate, name, 0);
    CHECK(plain == 1);
    CHECK(report.learning_rate == 0.0);
}

TEST_CASE(
    "finalize step: measurements read once name the parameters that are not finite, and clipping scales down "
    "only above the bound") {
    gradsync::spawn(1, [](gradsync::LocalBackend& local) {
        std::vector<float> w(8), g0(3, 3.0f), g1(5, 4.0f);
        std::vector<gradsync::Parameter> params = {{"a", w.data(), g0.data(), 3, DType::float32},
                                                   {"b", w.data() + 3, g1.data(), 5, DType::float32}};
        gradsync::BucketPlan plan;
        plan.buckets = {{DType::float32, {1}, 5}, {DType::float32, {0}, 3}};
        BucketEngine<gradsync::LocalBackend, gradsync::HostMemory, DType::float32, true> engine(local, {});
        engine.setup(plan, params);
        engine.begin_step(true, 1.0);
        for (std::size_t b = 0; b < 2; ++b) engine.finalize_in_place(b);
        auto stats = gradsync::detail::collect_stats(engine, [](std::size_t) { FAIL("no wire to redo"); });
        CHECK(stats.sum_squares == 3 * 9.0 + 5 * 16.0);
        CHECK(stats.finite());
        gradsync::detail::clip(engine, stats, 100.0);  // the norm is below: nothing changes
        CHECK_FALSE(stats.clipped);
        CHECK(g1[0] == 4.0f);
        gradsync::detail::clip(engine, stats, stats.norm() / 2);
        CHECK(stats.clipped);
        CHECK(g1[0] == doctest::Approx(2.0f).epsilon(1e-5));

        g0[1] = NAN;
        engine.begin_step(true, 1.0);
        for (std::size_t b = 0; b < 2; ++b) engine.finalize_in_place(b);
        stats = gradsync::detail::collect_stats(engine, [](std::size_t) {});
        CHECK_FALSE(stats.finite());
        CHECK(stats.nonfinite == std::vector<std::size_t>{0});
    });
}
