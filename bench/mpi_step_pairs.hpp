// Whole steps on two processes under MPI, each beside DataParallel::step (one allreduce per
// bucket) on the same layout and processes: ShardedDataParallel::step, and DataParallel::step
// with PowerSGD. Each side has its own copy of the model and plain SGD; they alternate in
// alternating order; an iteration's time is the slowest rank's; figures are medians.
#pragma once

#include <gradsync/backend/mpi.hpp>
#include <gradsync/gradsync.hpp>

#include "layout_model.hpp"
#include "model_layouts.hpp"
#include "stats.hpp"

#include <chrono>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace {

// Seconds `f` takes on the slowest rank, started together.
double timed(MPI_Comm comm, const std::function<void()>& f) {
    MPI_Barrier(comm);
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
    return slowest;
}

// Runs `a` and `b` `iterations` times (after two rounds of warm-up), alternating which goes
// first; returns the seconds of each and the per-iteration ratios a / b.
struct Timings {
    std::vector<double> a, b, ratios;
};
inline Timings alternate(const std::function<void()>& a, const std::function<void()>& b, int iterations) {
    Timings t;
    for (int i = -2; i < iterations; ++i) {
        double ta = 0, tb = 0;
        if (i % 2 == 0) {
            ta = timed(gradsync::mpi_world(), a);
            tb = timed(gradsync::mpi_world(), b);
        } else {
            tb = timed(gradsync::mpi_world(), b);
            ta = timed(gradsync::mpi_world(), a);
        }
        if (i < 0) continue;
        t.a.push_back(ta);
        t.b.push_back(tb);
        t.ratios.push_back(ta / tb);
    }
    return t;
}

// Plain SGD over every parameter of a DataParallel's model.
template <class Dp>
void sgd_step(Dp& dp) {
    constexpr float lr = 1e-6f;
    (void)dp.step([&] {
        for (const auto& p : dp.parameters()) {
            auto* w = static_cast<float*>(p.data);
            const auto* g = static_cast<const float*>(p.grad);
            for (std::size_t i = 0; i < p.count; ++i) w[i] -= lr * g[i];
        }
    });
}

// ShardedDataParallel::step against DataParallel::step on the same layout and processes, each
// with plain SGD on its own copy of the model, alternating in alternating order: the same bytes
// cross the link (reduce-scatter + all-gather against the allreduce, which is the two halves).
struct StepPair {
    std::string name;
    double sharded_ms = 0, unsharded_ms = 0, ratio = 0;  // medians; ratio of the per-iteration ratios
};

inline StepPair sharded_step(const std::string& name, const std::vector<layouts::Tensor>& tensors,
                             const gradsync::MpiOptions& options, int iterations) {
    gradsync::MpiBackend backend(gradsync::mpi_world(), options);
    bench::LayoutModel plain(tensors), split(tensors);
    gradsync::DataParallel dp(plain, backend);
    gradsync::ShardedDataParallel sdp(split, backend);
    constexpr float lr = 1e-6f;
    auto sharded = [&] {
        (void)sdp.step([&](std::span<const gradsync::ShardPiece<float>> pieces) {
            for (const auto& p : pieces)
                for (std::size_t i = 0; i < p.params.size(); ++i) p.params[i] -= lr * p.grads[i];
        });
    };
    const auto t = alternate(
        sharded, [&] { sgd_step(dp); }, iterations);
    StepPair pair{name, bench::median(t.a) * 1e3, bench::median(t.b) * 1e3, bench::median(t.ratios)};
    if (backend.rank() == 0) {
        std::printf("  %-22s sharded step %8.2f ms | DataParallel step %8.2f ms, ratio %.3f\n", name.c_str(),
                    pair.sharded_ms, pair.unsharded_ms, pair.ratio);
        std::fflush(stdout);
    }
    return pair;
}

// DataParallel::step with PowerSGD at rank 4 against the plain one: the time, and the values
// each rank hands to collectives per step against the plain allreduce's.
struct HookPair {
    std::string name;
    double hooked_ms = 0, plain_ms = 0, ratio = 0;
    double sent_mb = 0, plain_mb = 0, wire_ratio = 0;  // per step and rank
};

inline HookPair powersgd_step(const std::string& name, const std::vector<layouts::Tensor>& tensors,
                              const gradsync::MpiOptions& options, int iterations) {
    gradsync::MpiBackend backend(gradsync::mpi_world(), options);
    bench::LayoutModel plain(tensors), compressed(tensors);
    gradsync::DataParallel dp(plain, backend);
    gradsync::DataParallel hooked(compressed, backend, gradsync::PowerSGD({.rank = 4}));
    const auto t = alternate([&] { sgd_step(hooked); }, [&] { sgd_step(dp); }, iterations);
    const auto& hook = hooked.comm_hook();
    const double steps = static_cast<double>(hooked.steps());
    HookPair pair{name,
                  bench::median(t.a) * 1e3,
                  bench::median(t.b) * 1e3,
                  bench::median(t.ratios),
                  double(hook.elements_sent()) * sizeof(float) / steps / 1e6,
                  double(hook.elements_reduced()) * sizeof(float) / steps / 1e6,
                  double(hook.elements_sent()) / double(hook.elements_reduced())};
    if (backend.rank() == 0) {
        std::printf(
            "  %-22s PowerSGD step %8.2f ms | DataParallel step %8.2f ms, ratio %.3f | sent %.2f of %.2f "
            "MB per step (%.4f)\n",
            name.c_str(), pair.hooked_ms, pair.plain_ms, pair.ratio, pair.sent_mb, pair.plain_mb, pair.wire_ratio);
        std::fflush(stdout);
    }
    return pair;
}

}  // namespace
