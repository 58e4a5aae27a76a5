// The equivalence test: the example MLP trained 20 steps on N ranks with micro-batch b ends with
// the same parameters as one process trained on the whole batch N*b, for N = 1..4, every
// bucketer, both packings and two optimizers; and every rank ends every step bitwise identical.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int steps = 20;
constexpr int micro_batch = 8;
constexpr std::uint64_t data_seed = 2026;

struct SgdMomentum {
    mlp::Sgd make() const { return mlp::Sgd(0.05f, 0.9f); }
};
struct AdamOptimizer {
    mlp::Adam make() const { return mlp::Adam(1e-3f); }
};

using Weights = std::vector<std::vector<float>>;

Weights weights_of(const mlp::Mlp& m) { return {m.w1, m.b1, m.w2, m.b2}; }

std::uint64_t bits_hash(const mlp::Mlp& m) {
    std::uint64_t h = 1469598103934665603ull;
    for (const auto* v : {&m.w1, &m.b1, &m.w2, &m.b2}) {
        for (float x : *v) {
            std::uint32_t u;
            std::memcpy(&u, &x, 4);
            h = (h ^ u) * 1099511628211ull;
        }
    }
    return h;
}

template <class Opt>
Weights train_single(int world) {
    mlp::Mlp model(/*seed=*/1);
    auto opt = Opt{}.make();
    const int global = world * micro_batch;
    for (int s = 0; s < steps; ++s) {
        auto batch = mlp::make_batch(data_seed, static_cast<std::size_t>(s * global), global);
        model.forward_backward(batch);
        opt.step(model);
    }
    return weights_of(model);
}

// Returns rank 0's weights; checks that every rank held the same bits after every step.
template <class Opt, class... Policies>
Weights train_parallel(int world, Policies... policies) {
    Weights result;
    std::vector<std::vector<std::uint64_t>> hashes(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        // A different initialization per rank: construction must replace it with rank 0's.
        mlp::Mlp model(/*seed=*/1 + static_cast<std::uint64_t>(backend.rank()) * 1000);
        gradsync::DataParallel dp(model, backend, policies...);
        auto opt = Opt{}.make();
        const int global = world * micro_batch;
        for (int s = 0; s < steps; ++s) {
            auto first = static_cast<std::size_t>(s * global + backend.rank() * micro_batch);
            model.forward_backward(mlp::make_batch(data_seed, first, micro_batch));
            dp.synchronize();
            opt.step(model);
            hashes[static_cast<std::size_t>(backend.rank())].push_back(bits_hash(model));
        }
        if (backend.rank() == 0) result = weights_of(model);
    });
    for (const auto& h : hashes) CHECK(h == hashes[0]);
    return result;
}

// ||a - b|| / ||b|| per tensor.
void check_close(const Weights& parallel, const Weights& single) {
    REQUIRE(parallel.size() == single.size());
    for (std::size_t t = 0; t < single.size(); ++t) {
        double diff = 0, norm = 0;
        for (std::size_t i = 0; i < single[t].size(); ++i) {
            double d = double(parallel[t][i]) - double(single[t][i]);
            diff += d * d;
            norm += double(single[t][i]) * double(single[t][i]);
        }
        double rel = std::sqrt(diff) / std::sqrt(norm);
        CAPTURE(t);
        CHECK(rel <= 1e-5);
    }
}

template <class Opt>
void check_all_bucketers() {
    using namespace gradsync::literals;
    for (int world = 1; world <= 4; ++world) {
        CAPTURE(world);
        auto single = train_single<Opt>(world);
        check_close(train_parallel<Opt>(world, gradsync::SizeCappedBuckets{}), single);
        check_close(train_parallel<Opt>(world, gradsync::SizeCappedBuckets{64_KiB, 4_KiB}), single);
        check_close(train_parallel<Opt>(world, gradsync::SizeCappedBuckets{64_KiB, 4_KiB, true}), single);
        check_close(train_parallel<Opt>(world, gradsync::SingleBucket{}), single);
        check_close(train_parallel<Opt>(world, gradsync::PerParameterBuckets{}), single);
        check_close(train_parallel<Opt>(world, gradsync::SizeCappedBuckets{}, gradsync::PackedBuckets{}), single);
    }
}

}  // namespace

TEST_CASE("equivalence: N ranks with micro-batch b == one process with batch N*b (SGD with momentum)") {
    check_all_bucketers<SgdMomentum>();
}

TEST_CASE("equivalence: N ranks with micro-batch b == one process with batch N*b (Adam)") {
    check_all_bucketers<AdamOptimizer>();
}

TEST_CASE("training makes progress, so the equivalence is not between two idle models") {
    mlp::Mlp model(1);
    mlp::Sgd opt(0.05f, 0.9f);
    float first = 0, last = 0;
    for (int s = 0; s < steps; ++s) {
        float loss = model.forward_backward(mlp::make_batch(data_seed, static_cast<std::size_t>(s * 32), 32));
        opt.step(model);
        if (s == 0) first = loss;
        last = loss;
    }
    CHECK(last < 0.5f * first);
}
