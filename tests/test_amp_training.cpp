// The equivalence test in mixed precision: the MLP with float16 or bfloat16 weights and
// gradients, float32 master weights in the optimizer and dynamic loss scaling, trained 50 steps
// on 2 ranks (also with the 16-bit gradients averaged in float32 through a hook), ends with a
// loss within a stated tolerance of the same training in float32.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <vector>

namespace {

constexpr int steps = 50;
constexpr int micro_batch = 16;
constexpr int world = 2;
constexpr std::uint64_t data_seed = 99;
constexpr float learning_rate = 0.02f;  // where training is stable, so runs can be compared

// The model as mixed-precision training holds it: 16-bit weights and gradients, which
// DataParallel synchronizes, and float32 master weights, which the optimizer updates.
template <class T>
struct HalfMlp {
    mlp::Mlp compute{1};  // float32 arithmetic on the 16-bit weights
    std::vector<T> w[4], g[4];
    std::vector<float> master[4], velocity[4];

    HalfMlp() {
        auto* src = weights(compute);
        for (int k = 0; k < 4; ++k) {
            w[k].resize(src[k]->size());
            g[k].resize(src[k]->size());
            for (std::size_t i = 0; i < w[k].size(); ++i) w[k][i] = T((*src[k])[i]);
        }
    }
    static std::vector<float>* const* weights(mlp::Mlp& m) {
        static thread_local std::vector<float>* p[4];
        p[0] = &m.w1, p[1] = &m.b1, p[2] = &m.w2, p[3] = &m.b2;
        return p;
    }
    static std::vector<float>* const* grads(mlp::Mlp& m) {
        static thread_local std::vector<float>* p[4];
        p[0] = &m.gw1, p[1] = &m.gb1, p[2] = &m.gw2, p[3] = &m.gb2;
        return p;
    }
    static constexpr const char* names[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        for (int k = 0; k < 4; ++k) out.push_back(gradsync::parameter(names[k], w[k], g[k]));
        return out;
    }
    void start_master() {  // after DataParallel copied rank 0's weights
        for (int k = 0; k < 4; ++k) {
            master[k].resize(w[k].size());
            velocity[k].assign(w[k].size(), 0.0f);
            for (std::size_t i = 0; i < w[k].size(); ++i) master[k][i] = static_cast<float>(w[k][i]);
        }
    }
    // Forward and backward in float32 on the 16-bit weights; the scaled gradients are stored in
    // 16 bits, where an overflow becomes an infinity.
    float forward_backward(const mlp::Batch& batch, float loss_scale) {
        auto* cw = weights(compute);
        for (int k = 0; k < 4; ++k)
            for (std::size_t i = 0; i < w[k].size(); ++i) (*cw[k])[i] = static_cast<float>(w[k][i]);
        float loss = compute.forward_backward(batch, loss_scale);
        auto* cg = grads(compute);
        for (int k = 0; k < 4; ++k)
            for (std::size_t i = 0; i < g[k].size(); ++i) g[k][i] = T((*cg[k])[i]);
        return loss;
    }
    // SGD with momentum on the master weights, then rounded into the 16-bit weights; from the
    // 16-bit gradients, or from grad(k) (float32 ones).
    void sgd(float lr) {
        sgd(lr, [&](int k, std::size_t i) { return static_cast<float>(g[k][i]); });
    }
    template <class Grad>
    void sgd(float lr, Grad&& grad) {
        for (int k = 0; k < 4; ++k) {
            for (std::size_t i = 0; i < w[k].size(); ++i) {
                velocity[k][i] = 0.9f * velocity[k][i] + grad(k, i);
                master[k][i] -= lr * velocity[k][i];
                w[k][i] = T(master[k][i]);
            }
        }
    }
};

struct Run {
    std::vector<float> losses;  // rank 0's, per step
    std::vector<int> skipped_steps;
    float held_out = 0;  // the final model's loss on examples no step saw
    int skipped = 0;
    float final_scale = 0;
};

const mlp::Batch& held_out_batch() {
    static const mlp::Batch batch = mlp::make_batch(data_seed, 1u << 20, 512);
    return batch;
}

// Float32 training that skips the optimizer at `skip` (the steps a float16 run skipped), so that
// both have applied the same updates to the same batches.
Run train_float32(const std::vector<int>& skip = {}) {
    Run run;
    gradsync::spawn(world, [&](gradsync::LocalBackend& b) {
        mlp::Mlp model(1);
        gradsync::DataParallel dp(model, b);
        mlp::Sgd opt(learning_rate, 0.9f);
        for (int s = 0; s < steps; ++s) {
            auto first = static_cast<std::size_t>((s * world + b.rank()) * micro_batch);
            float loss = model.forward_backward(mlp::make_batch(data_seed, first, micro_batch));
            dp.synchronize();
            if (std::find(skip.begin(), skip.end(), s) == skip.end()) opt.step(model);
            if (b.rank() == 0) run.losses.push_back(loss);
        }
        if (b.rank() == 0) run.held_out = model.forward_backward(held_out_batch());
    });
    return run;
}

// With a communication hook given, the 16-bit gradients are averaged through it in float32, and
// the optimizer reads the float32 averages (DataParallel::float32_gradient).
template <class T, class... Hook>
Run train_mixed(Hook... hook) {
    Run run;
    gradsync::spawn(world, [&](gradsync::LocalBackend& b) {
        HalfMlp<T> model;
        gradsync::DataParallel dp(model, b, gradsync::DynamicLossScale{.init_scale = 524288.0f}, hook...);
        model.start_master();
        for (int s = 0; s < steps; ++s) {
            auto first = static_cast<std::size_t>((s * world + b.rank()) * micro_batch);
            float loss = model.forward_backward(mlp::make_batch(data_seed, first, micro_batch), dp.loss_scale());
            auto report = dp.step([&] {
                if constexpr (sizeof...(Hook) == 0) {
                    model.sgd(learning_rate);
                } else {
                    std::span<const float> grads[4];
                    for (int k = 0; k < 4; ++k) grads[k] = dp.float32_gradient(HalfMlp<T>::names[k]);
                    model.sgd(learning_rate, [&](int k, std::size_t i) { return grads[k][i]; });
                }
            });
            if (b.rank() == 0) {
                run.losses.push_back(loss);
                run.skipped += !report.applied;
                if (!report.applied) run.skipped_steps.push_back(s);
                run.final_scale = report.next_loss_scale;
            }
        }
        if (b.rank() == 0) run.held_out = model.forward_backward(held_out_batch(), 1.0f);
    });
    return run;
}

}  // namespace

TEST_CASE("mixed precision: float16 and bfloat16 with dynamic loss scaling train like float32") {
    const auto reference = train_float32();
    const auto half = train_mixed<gradsync::float16>();
    const auto brain = train_mixed<gradsync::bfloat16>();
    const auto reference_skipping = train_float32(half.skipped_steps);
    MESSAGE("held-out loss after " << steps << " steps: float32 " << reference.held_out << "; bfloat16 "
                                   << brain.held_out << " (" << brain.skipped << " skipped); float16 " << half.held_out
                                   << " (" << half.skipped << " steps skipped, final scale " << half.final_scale
                                   << ") against float32 skipping the same steps " << reference_skipping.held_out);
    // Training worked: the held-out loss fell from about 2.3 by an order of magnitude.
    CHECK(reference.losses.front() > 2.0f);
    CHECK(reference.held_out < 0.1f * reference.losses.front());
    // The stated tolerance: the held-out loss within 5% of float32's with the same updates.
    CHECK(std::fabs(brain.held_out - reference.held_out) <= 0.05f * reference.held_out);
    CHECK(std::fabs(half.held_out - reference_skipping.held_out) <= 0.05f * reference_skipping.held_out);
    // An initial scale of 2^19 overflows float16 at first: steps are skipped, the scale backs
    // off, and training goes on.
    CHECK(half.skipped >= 1);
    CHECK(half.skipped <= 5);
    CHECK(half.final_scale < 524288.0f);
}

TEST_CASE("mixed precision: 16-bit gradients averaged in float32 (AllreduceHook) train like float32 too") {
    // The hook widens each 16-bit bucket and averages it in float32; the optimizer reads the
    // float32 averages. A float16 overflow (an infinity in the widened copy) still skips the step
    // on every rank.
    const auto reference = train_float32();
    const auto brain = train_mixed<gradsync::bfloat16>(gradsync::AllreduceHook{});
    const auto half = train_mixed<gradsync::float16>(gradsync::AllreduceHook{});
    const auto reference_skipping = train_float32(half.skipped_steps);
    MESSAGE("held-out loss, averaged in float32: bfloat16 " << brain.held_out << ", float16 " << half.held_out << " ("
                                                            << half.skipped << " skipped); float32 "
                                                            << reference.held_out);
    CHECK(std::fabs(brain.held_out - reference.held_out) <= 0.05f * reference.held_out);
    CHECK(std::fabs(half.held_out - reference_skipping.held_out) <= 0.05f * reference_skipping.held_out);
    CHECK(half.skipped >= 1);
    CHECK(half.skipped <= 5);
}
