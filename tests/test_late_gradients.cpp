// Gradients that appear late: llm.c allocates its gradient blob in the first backward. A
// DataParallel made before the training loop copies rank 0's parameters to every rank at once
// (so step 0 averages gradients of one model, however each rank was seeded) and binds the
// gradients when they first exist; one still missing at synchronize() is an error naming it.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string_view>
#include <vector>

namespace {

constexpr int inputs = 5, micro_batch = 4, steps = 8;
constexpr std::array<std::size_t, 2> sizes = {inputs, 1};
constexpr std::array<std::string_view, 2> names = {"wte", "lnfb"};

// llm.c's shape: parameters in one blob, made at construction; gradients in another, made by
// the first backward.
struct LateModel {
    std::vector<float> params_memory = std::vector<float>(inputs + 1);
    float* grads_memory = nullptr;
    std::unique_ptr<float[]> grads_owner;

    explicit LateModel(int seed) {
        for (std::size_t i = 0; i < params_memory.size(); ++i)
            params_memory[i] = 0.1f * static_cast<float>((static_cast<int>(i) * 3 + seed * 7) % 5 - 2);
    }

    // Mean squared error of y = w.x + b over the batch; gradients of the mean.
    void backward(const std::vector<float>& x, const std::vector<float>& y) {
        if (grads_memory == nullptr) {  // as llm.c's gpt2_backward does on its first call
            grads_owner = std::make_unique<float[]>(params_memory.size());
            grads_memory = grads_owner.get();
        }
        std::fill(grads_memory, grads_memory + params_memory.size(), 0.0f);
        const std::size_t n = y.size();
        for (std::size_t k = 0; k < n; ++k) {
            float pred = params_memory[inputs];
            for (int i = 0; i < inputs; ++i) pred += params_memory[i] * x[k * inputs + i];
            const float err = (pred - y[k]) / static_cast<float>(n);
            for (int i = 0; i < inputs; ++i) grads_memory[i] += err * x[k * inputs + i];
            grads_memory[inputs] += err;
        }
    }
    void sgd(float lr) {
        for (std::size_t i = 0; i < params_memory.size(); ++i) params_memory[i] -= lr * grads_memory[i];
    }
};

std::vector<gradsync::Parameter> parameters(LateModel& m) {
    return gradsync::ContiguousParameters<float>(m.params_memory.data(), m.grads_memory, sizes, names).parameters();
}

void batch(int step, int first, int count, std::vector<float>& x, std::vector<float>& y) {
    x.resize(static_cast<std::size_t>(count * inputs));
    y.resize(static_cast<std::size_t>(count));
    for (int c = 0; c < count; ++c) {
        const int k = step * 100 + first + c;
        float target = 0.3f;
        for (int i = 0; i < inputs; ++i) {
            const float v = static_cast<float>((k * 13 + i * 7) % 9) / 4.0f - 1.0f;
            x[static_cast<std::size_t>(c * inputs + i)] = v;
            target += v * static_cast<float>(i + 1) * 0.2f;
        }
        y[static_cast<std::size_t>(c)] = target;
    }
}

std::vector<float> train_single(int world) {
    LateModel model(/*seed=*/0);
    std::vector<float> x, y;
    for (int s = 0; s < steps; ++s) {
        batch(s, 0, world * micro_batch, x, y);
        model.backward(x, y);
        model.sgd(0.1f);
    }
    return model.params_memory;
}

}  // namespace

TEST_CASE("a DataParallel made before llm.c's first backward binds the gradients when they appear") {
    for (bool overlap : {false, true}) {
        for (int world = 1; world <= 4; ++world) {
            CAPTURE(overlap);
            CAPTURE(world);
            const auto single = train_single(world);
            std::vector<std::vector<float>> finals(static_cast<std::size_t>(world));
            gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
                LateModel model(/*seed=*/backend.rank());                  // each rank seeded its own way
                gradsync::DataParallel dp(model, backend);                 // before any gradient exists
                CHECK(model.params_memory == LateModel(0).params_memory);  // rank 0's, already
                std::vector<float> x, y;
                for (int s = 0; s < steps; ++s) {
                    batch(s, backend.rank() * micro_batch, micro_batch, x, y);
                    model.backward(x, y);
                    if (overlap)
                        for (std::size_t i = 0; i < names.size(); ++i) dp.grad_ready(i);
                    dp.step([&] { model.sgd(0.1f); });
                }
                finals[static_cast<std::size_t>(backend.rank())] = model.params_memory;
            });
            for (int r = 1; r < world; ++r) CHECK(finals[static_cast<std::size_t>(r)] == finals[0]);  // bitwise
            for (std::size_t i = 0; i < single.size(); ++i)
                CHECK(std::abs(finals[0][i] - single[i]) <= 1e-5f * std::max(1.0f, std::abs(single[i])));
            CHECK(std::abs(single[0] - LateModel(0).params_memory[0]) > 1e-3f);  // training moved it
        }
    }
}

TEST_CASE("a gradient still missing at synchronize() is an error naming the parameter") {
    gradsync::spawn(1, [](gradsync::LocalBackend& backend) {
        LateModel model(0);
        gradsync::DataParallel dp(model, backend);
        CHECK_THROWS_WITH_AS(dp.synchronize(),
                             doctest::Contains("parameter 'lnfb' has no gradient now; a gradient made late (in the "
                                               "first backward) or freed between steps must exist"),
                             gradsync::InvalidModel);
        // (Buckets go last parameter first, as backward makes them.) Once the backward has made
        // them, the same DataParallel goes on.
        std::vector<float> x, y;
        batch(0, 0, micro_batch, x, y);
        model.backward(x, y);
        CHECK_NOTHROW(dp.synchronize());
    });
}
