// Mixed precision: the loss scalers' state machines, the fused finalize pass against the unfused
// sequence, step() skipping alike on every rank, clipping, wire compression and LR rules.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "support/recording_backend.hpp"
#include "support/toy_model.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace gradsync::literals;
using gradsync::DataParallel;
using gradsync::DynamicLossScale;
using gradsync::LocalBackend;
using testing_support::Toy;

TEST_CASE("dynamic loss scale: a table of overflow sequences worked out by hand") {
    // Grow x2 after 3 clean steps, back off x0.5 after 2 overflowing steps in a row, within [1, 32].
    DynamicLossScale s{.init_scale = 8, .growth_interval = 3, .backoff_after = 2, .min_scale = 1, .max_scale = 32};
    struct Row {
        bool overflow;
        float scale_after;
    };
    const Row table[] = {
        {false, 8},  {false, 8},  {false, 16},  // three clean steps: grow
        {true, 16},  {false, 16},               // one overflow, then clean: the overflow count restarts
        {true, 16},  {true, 8},                 // two in a row: back off
        {true, 8},   {true, 4},   {true, 4},   {true, 2},   {true, 2},
        {true, 1},   {true, 1},   {true, 1},   // at the minimum: stays, training goes on
        {false, 1},  {false, 1},  {false, 2},  // the clean count restarted at the last overflow
        {false, 2},  {false, 2},  {false, 4},  {false, 4},  {false, 4},
        {false, 8},  {false, 8},  {false, 8},  {false, 16}, {false, 16},
        {false, 16}, {false, 32}, {false, 32}, {false, 32}, {false, 32},  // at the maximum
    };
    CHECK(s.scale() == 8);
    int i = 0;
    for (const auto& row : table) {
        CAPTURE(i++);
        s.update(row.overflow);
        CHECK(s.scale() == row.scale_after);
    }
    CHECK(s.at_minimum() == false);
}

TEST_CASE("dynamic loss scale defaults follow PyTorch's GradScaler, and its state round-trips") {
    DynamicLossScale s;
    CHECK(s.scale() == 65536.0f);
    s.update(true);
    CHECK(s.scale() == 32768.0f);  // backs off at the first overflow
    for (int k = 0; k < 1999; ++k) s.update(false);
    CHECK(s.scale() == 32768.0f);
    s.update(false);
    CHECK(s.scale() == 65536.0f);  // grows after 2000 clean steps

    DynamicLossScale a{.init_scale = 1024, .growth_interval = 4, .backoff_after = 3};
    for (bool o : {false, true, true, false, false}) a.update(o);
    DynamicLossScale b{.init_scale = 1024, .growth_interval = 4, .backoff_after = 3};
    b.state = a.state;  // a checkpoint restores the scale and both counters
    for (bool o : {false, false, true, true, true, false}) {
        a.update(o);
        b.update(o);
        CHECK(a.scale() == b.scale());
        CHECK(a.state == b.state);
    }

    gradsync::StaticLossScale fixed{.value = 1024};
    fixed.update(true);
    CHECK(fixed.scale() == 1024);
    CHECK_THROWS_WITH_AS(DynamicLossScale{.min_scale = 0}.update(false), doctest::Contains("0 < min_scale"),
                         gradsync::Error);
}

namespace {

// The unfused sequence every peer runs: average, unscale, check for non-finite values, norm;
// four passes, in float (double for double), rounding to the storage type at the end.
template <class T>
struct Unfused {
    std::vector<T> data;
    bool finite = true;
    double sum_squares = 0;
};

template <class T>
Unfused<T> unfused(std::vector<T> g, int world, float scale) {
    using A = gradsync::detail::accumulator_t<T>;
    std::vector<A> wide(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) wide[i] = static_cast<A>(g[i]);
    for (auto& x : wide) x *= A(1) / static_cast<A>(world);
    for (auto& x : wide) x *= A(1) / static_cast<A>(scale);
    Unfused<T> out;
    out.data.resize(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) out.data[i] = T(wide[i]);
    for (auto& x : out.data) out.finite = out.finite && std::isfinite(static_cast<double>(static_cast<A>(x)));
    for (auto& x : out.data) out.sum_squares += double(static_cast<A>(x)) * double(static_cast<A>(x));
    return out;
}

template <class T>
std::vector<T> random_gradients(std::size_t n, unsigned seed, int plant) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> d(-3000.0f, 3000.0f);
    std::vector<T> g(n);
    for (auto& x : g) x = T(d(rng));
    std::uniform_int_distribution<std::size_t> where(0, n - 1);
    const float specials[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
    for (int k = 0; k < plant; ++k) g[where(rng)] = T(specials[static_cast<std::size_t>(k) % 3]);
    return g;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
void check_fused_equals_unfused() {
    for (int trial = 0; trial < 40; ++trial) {
        const std::size_t n = 1 + static_cast<std::size_t>(trial) * 997;
        const int world = 1 + trial % 4;
        const float scale = std::ldexp(1.0f, trial % 17);  // loss scales are powers of two
        const int plant = trial % 3 == 0 ? 1 + trial % 5 : 0;
        CAPTURE(trial);
        auto g = random_gradients<T>(n, static_cast<unsigned>(trial), plant);
        auto want = unfused(g, world, scale);

        gradsync::detail::SquareSum sums;  // in place
        auto fused = g;
        gradsync::detail::scale_square_sum(fused.data(), n, 1.0 / (double(world) * double(scale)), sums);
        CHECK(same_bits(fused, want.data));
        CHECK(std::isfinite(sums.total()) == want.finite);
        if (want.finite) CHECK(sums.total() == doctest::Approx(want.sum_squares).epsilon(1e-12));

        gradsync::detail::SquareSum copied_sums;  // unpacking into the gradient
        std::vector<T> out(n);
        gradsync::detail::scale_copy_square_sum(g.data(), out.data(), n, 1.0 / (double(world) * double(scale)),
                                                copied_sums);
        CHECK(same_bits(out, want.data));
        CHECK((copied_sums.total() == sums.total() || (std::isnan(sums.total()) && std::isnan(copied_sums.total()))));
    }
}

// A float32 wire (or a hook's float32 average) finalized into 16-bit gradients: each written value
// is T(float(in) * float(factor)), rounded once, and the squares are those of what was written,
// summed in the lanes' order, bitwise. Lengths cover whole blocks, tails and neither.
template <class T>
void check_float_into_16_bit() {
    for (int trial = 0; trial < 30; ++trial) {
        const std::size_t n = static_cast<std::size_t>(trial) * 131 + (trial % 2 == 0 ? 64 : 1);
        const double factor = trial % 3 == 0 ? 1.0 : 1.0 / (3.0 * std::ldexp(1.0, trial % 9));
        const int plant = trial % 4 == 0 ? 1 + trial % 3 : 0;
        CAPTURE(trial);
        auto in = random_gradients<float>(n, static_cast<unsigned>(trial) + 100, plant);
        // Values halfway between two 16-bit neighbours, where rounding to even decides.
        for (std::size_t i = 5; i < n; i += 17) in[i] = 1.0f + std::ldexp(1.0f, -8) * (i % 2 == 0 ? 1.0f : 3.0f);
        std::vector<T> want(n);
        gradsync::detail::SquareSum want_sums;
        for (std::size_t i = 0; i < n; ++i) {
            want[i] = T(in[i] * static_cast<float>(factor));
            const double v = static_cast<float>(want[i]);
            want_sums.lanes[i < n - n % gradsync::detail::simd_width ? i % gradsync::detail::simd_width : 0] += v * v;
        }
        std::vector<T> out(n);
        gradsync::detail::SquareSum sums;
        gradsync::detail::scale_copy_square_sum(in.data(), out.data(), n, factor, sums);
        CHECK(same_bits(out, want));
        const double got = sums.total(), expected = want_sums.total();
        CHECK((got == expected || (std::isnan(got) && std::isnan(expected))));
    }
}

}  // namespace

TEST_CASE("float32 finalized into float16 and bfloat16 gradients: rounded once, squares of what was written") {
    check_float_into_16_bit<gradsync::bfloat16>();
    check_float_into_16_bit<gradsync::float16>();
}

TEST_CASE("the fused finalize pass equals the unfused sequence, with inf and NaN planted, every dtype") {
    check_fused_equals_unfused<float>();
    check_fused_equals_unfused<double>();
    check_fused_equals_unfused<gradsync::float16>();
    check_fused_equals_unfused<gradsync::bfloat16>();
}

TEST_CASE("step(): one rank overflows, every rank skips, and the scale backs off alike") {
    std::vector<std::vector<gradsync::StepReport>> reports(3);
    std::vector<std::vector<float>> weights(3);
    std::vector<int> optimizer_calls(3, 0);
    gradsync::spawn(3, [&](LocalBackend& b) {
        Toy m({50, 70, 90}, 1.0f);
        DataParallel dp(m, b, DynamicLossScale{.init_scale = 1024, .growth_interval = 100});
        auto& mine = reports[static_cast<std::size_t>(b.rank())];
        auto sgd = [&] {
            ++optimizer_calls[static_cast<std::size_t>(b.rank())];
            for (auto& t : m.tensors)
                for (std::size_t i = 0; i < t.w.size(); ++i) t.w[i] -= 0.1f * t.g[i];
        };
        for (int step = 0; step < 3; ++step) {
            m.fill_grads(b.rank());
            for (auto& t : m.tensors)
                for (auto& g : t.g) g *= dp.loss_scale();  // backward of the scaled loss
            if (step == 1 && b.rank() == 1) m.tensors[1].g[7] = std::numeric_limits<float>::infinity();
            mine.push_back(dp.step(sgd));
        }
        weights[static_cast<std::size_t>(b.rank())] = m.tensors[1].w;
    });
    for (int r = 0; r < 3; ++r) {
        const auto& rep = reports[static_cast<std::size_t>(r)];
        CAPTURE(r);
        CHECK(rep[0].applied);
        CHECK(rep[0].loss_scale == 1024);
        CHECK_FALSE(rep[1].applied);  // rank 1's infinity reached every rank through the reduction
        CHECK(rep[1].overflowed == std::vector<std::string>{"t1"});
        CHECK(rep[1].next_loss_scale == 512);
        CHECK(rep[2].applied);
        CHECK(rep[2].loss_scale == 512);
        CHECK(rep[2].step == 3);
        CHECK(optimizer_calls[static_cast<std::size_t>(r)] == 2);
        CHECK(weights[static_cast<std::size_t>(r)] == weights[0]);
        // Two applied steps of the unscaled average: w = 1 - 0.1 * avg - 0.1 * avg.
        const float avg = testing_support::expected_average<float>(3, 1, 3);
        CHECK(weights[static_cast<std::size_t>(r)][3] == doctest::Approx(1.0f - 0.2f * avg).epsilon(1e-6));
        CHECK(std::isfinite(rep[0].grad_norm));
        CHECK_FALSE(std::isfinite(rep[1].grad_norm));
    }
}

TEST_CASE("gradients are unscaled exactly, on every path") {
    auto check = [](auto... policies) {
        std::vector<std::vector<float>> grads(2);
        gradsync::spawn(2, [&](LocalBackend& b) {
            Toy m({30, 3000, 5}, 0.0f);
            DataParallel dp(m, b, gradsync::StaticLossScale{.value = 256}, policies...);
            m.fill_grads(b.rank());
            for (auto& t : m.tensors)
                for (auto& g : t.g) g *= 256.0f;
            dp.synchronize();
            CHECK(dp.gradients_finite());
            grads[static_cast<std::size_t>(b.rank())] = m.tensors[1].g;
        });
        for (const auto& g : grads)
            for (std::size_t i = 0; i < g.size(); ++i) CHECK(g[i] == testing_support::expected_average<float>(2, 1, i));
    };
    check();
    check(gradsync::PackedBuckets{});
    check(gradsync::PerParameterBuckets{});
    check(gradsync::Bf16Compression{});  // small integers survive bfloat16
    check(gradsync::Fp16Compression{});
    auto ranks = LocalBackend::create_group(1);  // one rank still unscales
    Toy m({10}, 0.0f);
    DataParallel dp(m, ranks[0], gradsync::StaticLossScale{.value = 8});
    std::fill(m.tensors[0].g.begin(), m.tensors[0].g.end(), 24.0f);
    dp.synchronize();
    CHECK(m.tensors[0].g[9] == 3.0f);
    CHECK(dp.grad_norm() == doctest::Approx(std::sqrt(10 * 9.0)));
}

TEST_CASE("at the minimum loss scale an overflow skips the step, names the tensors, and training goes on") {
    auto ranks = LocalBackend::create_group(1);
    Toy m({10, 20}, 0.0f);
    DataParallel dp(m, ranks[0], DynamicLossScale{.init_scale = 1, .min_scale = 1});
    int calls = 0;
    m.tensors[0].g[3] = std::numeric_limits<float>::quiet_NaN();
    auto r = dp.step([&] { ++calls; });
    CHECK_FALSE(r.applied);
    CHECK(r.overflowed == std::vector<std::string>{"t0"});
    CHECK(r.next_loss_scale == 1);
    m.tensors[0].g[3] = 0.5f;
    auto again = dp.step([&] { ++calls; });
    CHECK(again.applied);
    CHECK(calls == 1);
}

TEST_CASE("clipping by the global norm: a second pass only when it scales") {
    auto ranks = LocalBackend::create_group(1);
    Toy m({3, 1}, 0.0f);
    DataParallel dp(m, ranks[0], gradsync::Options{.clip_norm = 1.0});
    m.tensors[0].g = {3.0f, 0.0f, 0.0f};
    m.tensors[1].g = {4.0f};
    auto r = dp.step([] {});
    CHECK(r.grad_norm == doctest::Approx(5.0));
    CHECK(r.clipped);
    CHECK(m.tensors[0].g[0] == doctest::Approx(0.6f).epsilon(1e-5));
    CHECK(m.tensors[1].g[0] == doctest::Approx(0.8f).epsilon(1e-5));
    m.tensors[0].g = {0.3f, 0.0f, 0.0f};
    m.tensors[1].g = {0.4f};
    auto small = dp.step([] {});
    CHECK_FALSE(small.clipped);
    CHECK(m.tensors[1].g[0] == 0.4f);
}

TEST_CASE("wire compression halves the bytes, and a float16 overflow is reduced again in float32") {
    std::vector<std::vector<testing_support::Collective>> logs(2);
    std::vector<std::vector<float>> grads(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        testing_support::RecordingBackend rec(b);
        Toy m({100, 200}, 0.0f);
        DataParallel dp(m, rec, gradsync::Fp16Compression{}, gradsync::SingleBucket{});
        rec.log.clear();
        for (auto& t : m.tensors) std::fill(t.g.begin(), t.g.end(), 0.25f);
        dp.synchronize();
        CHECK(m.tensors[0].g[0] == 0.25f);
        // Each rank sends 1e5 / 2 (fine in float16); their sum, 1e5, is not: reduced again.
        for (auto& t : m.tensors) std::fill(t.g.begin(), t.g.end(), 1.0e5f);
        dp.synchronize();
        grads[static_cast<std::size_t>(b.rank())] = m.tensors[1].g;
        logs[static_cast<std::size_t>(b.rank())] = rec.log;
    });
    for (int r = 0; r < 2; ++r) {
        const auto& log = logs[static_cast<std::size_t>(r)];
        REQUIRE(log.size() == 5);  // step 1: bucket, history check; step 2: bucket, float32 again, check
        CHECK(log[0].dtype == gradsync::DType::float16);
        CHECK(log[0].count == 300);
        CHECK(log[2].dtype == gradsync::DType::float16);
        CHECK(log[3].dtype == gradsync::DType::float32);
        CHECK(log[3].count == 300);
        for (float g : grads[static_cast<std::size_t>(r)]) CHECK(g == 1.0e5f);
    }
}

TEST_CASE("LR rules follow their formulas, warm-up endpoints included") {
    using gradsync::LrScaling;
    CHECK(gradsync::learning_rate(0.1, LrScaling::linear, 32, 128, 0) == doctest::Approx(0.4));
    CHECK(gradsync::learning_rate(0.1, LrScaling::square_root, 32, 128, 0) == doctest::Approx(0.2));
    CHECK(gradsync::learning_rate(0.1, LrScaling::none, 32, 128, 0) == doctest::Approx(0.1));
    CHECK(gradsync::learning_rate(0.1, LrScaling::linear, 256, 512, 7) == doctest::Approx(0.2));
    // Warm-up over 100 steps from 0.1 to 0.8: step 0, 50, 100 and beyond.
    CHECK(gradsync::learning_rate(0.1, LrScaling::linear, 32, 256, 0, 100) == doctest::Approx(0.1));
    CHECK(gradsync::learning_rate(0.1, LrScaling::linear, 32, 256, 50, 100) == doctest::Approx(0.45));
    CHECK(gradsync::learning_rate(0.1, LrScaling::linear, 32, 256, 100, 100) == doctest::Approx(0.8));
    CHECK(gradsync::learning_rate(0.1, LrScaling::linear, 32, 256, 1000, 100) == doctest::Approx(0.8));
    CHECK(gradsync::learning_rate(0.1, LrScaling::square_root, 32, 128, 1, 2) ==
          doctest::Approx(0.1 + (0.2 - 0.1) * 0.5));
    CHECK_THROWS_AS(gradsync::learning_rate(0.1, LrScaling::linear, 0, 128, 0), gradsync::Error);

    // PaddlePaddle's base_lr * num_gpus: LinearLr with the micro-batch as reference.
    gradsync::LinearLr rule{.base_lr = 0.1, .micro_batch = 64};
    CHECK(rule.rate(4, 0) == doctest::Approx(0.4));
    gradsync::SqrtLr accumulate{.base_lr = 0.1, .micro_batch = 16, .reference_batch = 64, .accumulation_steps = 4};
    CHECK(accumulate.rate(4, 0) == doctest::Approx(0.2));  // global batch 256 = 4 x 64
}

TEST_CASE("step() hands the LR policy's rate to the optimizer, step by step") {
    std::vector<double> seen;
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy m({10}, 0.0f);
        DataParallel dp(m, b, gradsync::LinearLr{.base_lr = 0.1, .micro_batch = 8, .warmup_steps = 2});
        CHECK(dp.learning_rate() == doctest::Approx(0.1));
        const double expected[] = {0.1, 0.15, 0.2};
        for (int s = 0; s < 3; ++s) {
            auto r = dp.step([&](double lr) {
                if (b.rank() == 0) seen.push_back(lr);
            });
            CHECK(r.learning_rate == doctest::Approx(expected[s]));
        }
    });
    REQUIRE(seen.size() == 3);
    CHECK(seen[0] == doctest::Approx(0.1));   // warm-up starts at the base rate
    CHECK(seen[1] == doctest::Approx(0.15));  // halfway to 0.1 x 2 ranks
    CHECK(seen[2] == doctest::Approx(0.2));
}

TEST_CASE("16-bit gradients: a mixed model gets buckets per dtype, summed in float") {
    struct Mixed {
        std::vector<gradsync::float16> h = std::vector<gradsync::float16>(64), gh = std::vector<gradsync::float16>(64);
        std::vector<gradsync::bfloat16> b = std::vector<gradsync::bfloat16>(32),
                                        gb = std::vector<gradsync::bfloat16>(32);
        std::vector<float> f = std::vector<float>(16), gf = std::vector<float>(16);
        std::vector<gradsync::Parameter> parameters() {
            return {gradsync::parameter("h", h, gh), gradsync::parameter("b", b, gb), gradsync::parameter("f", f, gf)};
        }
    };
    std::vector<float> h_result(3), b_result(3);
    gradsync::spawn(3, [&](LocalBackend& b) {
        Mixed m;
        DataParallel dp(m, b, gradsync::SingleBucket{});
        CHECK(dp.plan().buckets.size() == 3);
        const float mine = 1000.0f + static_cast<float>(b.rank());  // 1000, 1001, 1002
        std::fill(m.gh.begin(), m.gh.end(), gradsync::float16(mine));
        std::fill(m.gb.begin(), m.gb.end(), gradsync::bfloat16(mine));
        dp.synchronize();
        h_result[static_cast<std::size_t>(b.rank())] = static_cast<float>(m.gh[5]);
        b_result[static_cast<std::size_t>(b.rank())] = static_cast<float>(m.gb[5]);
    });
    for (int r = 0; r < 3; ++r) {
        CHECK(h_result[static_cast<std::size_t>(r)] == 1001.0f);  // float16 holds 1001 exactly
        CHECK(b_result[static_cast<std::size_t>(r)] ==
              static_cast<float>(
                  gradsync::bfloat16((float(gradsync::bfloat16(1000.0f)) + float(gradsync::bfloat16(1001.0f)) +
                                      float(gradsync::bfloat16(1002.0f))) *
                                     (1.0f / 3.0f))));
    }
}
