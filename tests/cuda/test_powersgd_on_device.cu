// CudaPowerSGD: PowerSGD on device memory (CudaLocalBackend and NcclBackend with CudaMemory). It
// computes what PowerSGD computes on the host, step after step with error feedback and warm start
// (to rounding: sums run in another order), every rank alike bit for bit; at full rank it is the
// plain average; an overflow on one rank skips the step on every rank and leaves the state as it
// was; its state is checkpointed; a step_on_device with it has no host wait. Suite "gpu": run on a GPU, and here on the
// stand-in CUDA runtime and NCCL (tests/standin), which run the kernels' host references.
#include <doctest/doctest.h>

#include <gradsync/backend/cuda_local.cuh>
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/backend/local.hpp>
#include <gradsync/backend/nccl.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/nccl_spawn.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/memory/cuda.cuh>
#include <gradsync/reduction/powersgd.hpp>
#include <gradsync/reduction/powersgd_cuda.cuh>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "device_support.cuh"
#include "support/temp_dir.hpp"

using namespace device_test;

namespace {

static_assert(gradsync::CommHook<gradsync::CudaPowerSGD>);

constexpr float loss_scale = 64.0f;
const auto buckets = gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{2048}};
// Matrices of several shapes (one too small to gain at rank 2 unless told, one of several chunks of
// rows for the M^T P pass) and a bias.
const std::vector<std::vector<std::size_t>> shapes{{24, 16}, {16}, {12, 40}, {3, 5}, {40, 8}, {300, 6}};
constexpr int steps = 4;

std::size_t elements(const std::vector<std::size_t>& shape) {
    std::size_t n = 1;
    for (auto d : shape) n *= d;
    return n;
}

// Rank r's unscaled gradient of tensor t at element i and step s: in [-0.5, 0.5).
float gradient_value(std::size_t t, std::size_t i, int r, int s) {
    std::uint64_t x = std::uint64_t(r) * 1000003u + std::uint64_t(s) * 7919u + t * 104729u + i;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return float(x >> 40) / 16777216.0f - 0.5f;
}

// Each step's gradients, by tensor, on one rank.
using Grads = std::vector<std::vector<std::vector<float>>>;

// The host reference: PowerSGD on LocalBackend threads, `world` ranks, `steps` steps.
std::vector<Grads> on_host(int world, gradsync::PowerSGDConfig config,
                           std::vector<std::map<std::string, gradsync::PowerSGDState>>* state = nullptr) {
    std::vector<Grads> out(static_cast<std::size_t>(world));
    if (state != nullptr) state->resize(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        const int r = backend.rank();
        std::vector<std::vector<float>> w, g;
        for (const auto& s : shapes) {
            w.emplace_back(elements(s), 0.5f);
            g.emplace_back(elements(s));
        }
        struct Model {
            std::vector<std::vector<float>>*w, *g;
            std::vector<gradsync::Parameter> parameters() {
                std::vector<gradsync::Parameter> out;
                for (std::size_t t = 0; t < shapes.size(); ++t)
                    out.push_back(gradsync::parameter("t" + std::to_string(t), (*w)[t], (*g)[t], shapes[t]));
                return out;
            }
        } model{&w, &g};
        gradsync::DataParallel dp(model, backend, gradsync::StaticLossScale{.value = loss_scale}, buckets,
                                  gradsync::PowerSGD(config));
        for (int s = 0; s < steps; ++s) {
            for (std::size_t t = 0; t < shapes.size(); ++t)
                for (std::size_t i = 0; i < g[t].size(); ++i) g[t][i] = gradient_value(t, i, r, s) * loss_scale;
            CHECK(dp.step([] {}).applied);
            out[std::size_t(r)].push_back(g);
        }
        if (state != nullptr) (*state)[std::size_t(r)] = dp.comm_hook().state();
    });
    return out;
}

// The same model with each tensor in device memory.
struct DeviceMatrices {
    std::deque<DeviceArray<float>> weights, grads;  // a deque keeps each where it is made
    DeviceMatrices() {
        for (const auto& s : shapes) {
            weights.emplace_back(elements(s));
            grads.emplace_back(elements(s));
        }
    }
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        for (std::size_t t = 0; t < shapes.size(); ++t)
            out.push_back({"t" + std::to_string(t), weights[t].data, grads[t].data, elements(shapes[t]),
                           gradsync::DType::float32, shapes[t]});
        return out;
    }
    // Rank r's gradients at step s times `scale`; element `poison` of tensor 0 made infinite.
    void set_gradients(cudaStream_t stream, int r, int s, float scale, bool poison = false) {
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (std::size_t t = 0; t < shapes.size(); ++t) {
            std::vector<float> host(elements(shapes[t]));
            for (std::size_t i = 0; i < host.size(); ++i) host[i] = gradient_value(t, i, r, s) * scale;
            if (poison && t == 0) host[3] = INFINITY;
            grads[t].upload(host);
        }
        GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
    }
    std::vector<std::vector<float>> download(cudaStream_t stream) const {
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<std::vector<float>> out;
        for (const auto& g : grads) out.push_back(g.download());
        return out;
    }
};

// CudaPowerSGD over `backend`: each step's gradients (odd steps overlapped with backward).
template <class B>
Grads on_device(B& backend, cudaStream_t stream, const gradsync::CudaPowerSGD& hook,
                std::map<std::string, gradsync::PowerSGDState>* state = nullptr) {
    DeviceMatrices model;
    gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                              gradsync::StaticLossScale{.value = loss_scale}, buckets, hook);
    Grads out;
    for (int s = 0; s < steps; ++s) {
        model.set_gradients(stream, backend.rank(), s, loss_scale);
        if (s % 2 == 1)
            for (std::size_t i = shapes.size(); i-- > 0;) dp.grad_ready(i);
        CHECK(dp.step([] {}).applied);
        out.push_back(model.download(stream));
    }
    if (state != nullptr) *state = dp.comm_hook().state_on_host();
    return out;
}

float max_difference(const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    float d = 0;
    for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
    return d;
}
float max_difference(const Grads& a, const Grads& b) {
    REQUIRE(a.size() == b.size());
    float d = 0;
    for (std::size_t s = 0; s < a.size(); ++s)
        for (std::size_t t = 0; t < a[s].size(); ++t) d = std::max(d, max_difference(a[s][t], b[s][t]));
    return d;
}

float max_magnitude(const std::vector<float>& v) {
    float m = 0;
    for (float x : v) m = std::max(m, std::fabs(x));
    return m;
}

// The plain average of each step's gradients over `world` ranks.
Grads plain_average(int world) {
    Grads out(steps);
    for (int s = 0; s < steps; ++s)
        for (std::size_t t = 0; t < shapes.size(); ++t) {
            std::vector<float> avg(elements(shapes[t]));
            for (std::size_t i = 0; i < avg.size(); ++i) {
                float sum = 0;
                for (int r = 0; r < world; ++r) sum += gradient_value(t, i, r, s);
                avg[i] = sum / float(world);
            }
            out[std::size_t(s)].push_back(avg);
        }
    return out;
}

}  // namespace

TEST_SUITE("gpu") {
    TEST_CASE(
        "CudaPowerSGD (CudaLocalBackend, CudaMemory) computes what PowerSGD computes on the host, step after step, "
        "every rank alike bit for bit; its error and Q as the host's") {
        const std::vector<gradsync::PowerSGDConfig> configs{
            {.rank = 2},                                                           // error feedback, warm start
            {.rank = 1, .error_feedback = false, .warm_start = false, .seed = 7},  // a fresh Q every step
            {.rank = 3, .min_compression_rate = 0}};                               // every matrix compressed
        for (int world : {2, 3}) {
            for (const auto& config : configs) {
                CAPTURE(world);
                CAPTURE(config.rank);
                std::vector<std::map<std::string, gradsync::PowerSGDState>> host_state;
                const auto host = on_host(world, config, &host_state);
                std::vector<Grads> device(static_cast<std::size_t>(world));
                std::vector<std::map<std::string, gradsync::PowerSGDState>> device_state(
                    static_cast<std::size_t>(world));
                // One hook handed to every rank: each DataParallel's copy has a state of its own.
                const gradsync::CudaPowerSGD hook(config);
                on_cuda_local_with_stream(world, [&](gradsync::CudaLocalBackend& backend, cudaStream_t stream) {
                    const auto r = std::size_t(backend.rank());
                    device[r] = on_device(backend, stream, hook, &device_state[r]);
                });
                // Low rank is far from the plain average, so agreeing with the host says something.
                CHECK(max_difference(host[0], plain_average(world)) > 1e-2f);
                for (std::size_t r = 0; r < std::size_t(world); ++r) {
                    CAPTURE(r);
                    CHECK(max_difference(device[r], host[r]) < 2e-5f);
                    CHECK(device[r] == device[0]);
                    REQUIRE(device_state[r].size() == host_state[r].size());
                    for (const auto& [name, st] : host_state[r]) {
                        CAPTURE(name);
                        const auto& mine = device_state[r].at(name);
                        CHECK(max_difference(mine.error, st.error) < 2e-5f);
                        CHECK(max_difference(mine.q, st.q) < 2e-6f * max_magnitude(st.q));  // Q carries the loss scale
                    }
                }
            }
        }
    }

    TEST_CASE("CudaPowerSGD at full rank (NcclBackend, one rank per GPU) is the plain average, every rank alike") {
        const int n = gradsync::cuda_devices().count;
        if (n < 2) MESSAGE("one GPU: a world of one runs no hook");
        std::vector<Grads> device(static_cast<std::size_t>(n));
        on_nccl_with_stream(n, [&](gradsync::NcclBackend<>& backend, cudaStream_t stream) {
            device[std::size_t(backend.rank())] =
                on_device(backend, stream, gradsync::CudaPowerSGD({.rank = 64, .min_compression_rate = 0}));
        });
        const auto plain = plain_average(n);
        for (std::size_t r = 0; r < std::size_t(n); ++r) {
            CAPTURE(r);
            CHECK(max_difference(device[r], plain) < 1e-5f);
            CHECK(device[r] == device[0]);
        }
    }

    TEST_CASE(
        "CudaPowerSGD with a loss scaler: an overflow on one rank skips the step on every rank and leaves the error "
        "and Q of its bucket's matrices as they were") {
        std::vector<int> applied(2);
        std::vector<std::map<std::string, gradsync::PowerSGDState>> before(2), after(2);
        on_cuda_local_with_stream(2, [&](gradsync::CudaLocalBackend& backend, cudaStream_t stream) {
            const auto r = std::size_t(backend.rank());
            DeviceMatrices model;
            gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream}, gradsync::DynamicLossScale{},
                                      buckets, gradsync::CudaPowerSGD({.rank = 1, .min_compression_rate = 0}));
            model.set_gradients(stream, backend.rank(), 0, dp.loss_scale());
            (void)dp.step([] {});
            before[r] = dp.comm_hook().state_on_host();
            model.set_gradients(stream, backend.rank(), 1, dp.loss_scale(), /*poison=*/r == 1);
            applied[r] = dp.step([] {}).applied ? 1 : 0;
            after[r] = dp.comm_hook().state_on_host();
        });
        CHECK(applied == std::vector<int>{0, 0});
        for (std::size_t r = 0; r < 2; ++r) {
            CAPTURE(r);
            REQUIRE(before[r].count("t0") == 1);
            CHECK(max_difference(before[r].at("t0").error, std::vector<float>(16 * 24, 0.0f)) > 0);
            // No other matrix shares t0's bucket; t2's bucket held finite sums.
            CHECK(after[r].at("t0").error == before[r].at("t0").error);
            CHECK(after[r].at("t0").q == before[r].at("t0").q);
            CHECK(after[r].at("t2").q != before[r].at("t2").q);
        }
    }

    TEST_CASE("step_on_device with CudaPowerSGD (NcclBackend, one rank per GPU): the host waits for none of its work") {
        const int n = gradsync::cuda_devices().count;
        if (n < 2) MESSAGE("one GPU: a world of one runs no hook, so this checks the step alone");
        std::vector<int> running(static_cast<std::size_t>(n), 0);
        on_nccl_with_stream(n, [&](gradsync::NcclBackend<>& backend, cudaStream_t stream) {
            const auto r = std::size_t(backend.rank());
            DeviceMatrices model;
            gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                                      gradsync::StaticLossScale{.value = loss_scale}, buckets,
                                      gradsync::Options{.check_histories = false}, gradsync::CudaPowerSGD({.rank = 2}));
            model.set_gradients(stream, backend.rank(), 0, loss_scale);
            running[r] =
                returns_while_queued_work_runs(stream, [&] { dp.step_on_device([](const gradsync::StepVerdict*) {}); });
            CHECK(dp.comm_hook().elements_sent() < dp.comm_hook().elements_reduced());
        });
        CHECK(running == std::vector<int>(static_cast<std::size_t>(n), 1));
    }

    TEST_CASE(
        "CudaPowerSGD's state is checkpointed from device memory: 6 steps == 3, save, a new group, load, 3 more") {
        // The gradients do not depend on the weights here, so the last step's average depends on
        // the carried error and Q alone: a state not restored would change it.
        TempDir dir;
        const auto path = dir.path / "powersgd_device.safetensors";
        const gradsync::PowerSGDConfig config{.rank = 2};
        // Steps [from, to) over `dp`: the last one's gradients.
        const auto train = [](auto& backend, cudaStream_t stream, DeviceMatrices& model, auto& dp, int from, int to) {
            std::vector<std::vector<float>> last;
            for (int s = from; s < to; ++s) {
                model.set_gradients(stream, backend.rank(), s, loss_scale);
                CHECK(dp.step([] {}).applied);
                last = model.download(stream);
            }
            return last;
        };
        std::vector<std::vector<std::vector<float>>> straight(2), resumed(2), unrestored(2);
        const auto run = [&](auto&& body) {
            on_cuda_local_with_stream(2, [&](gradsync::CudaLocalBackend& backend, cudaStream_t stream) {
                DeviceMatrices model;
                gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                                          gradsync::StaticLossScale{.value = loss_scale}, buckets,
                                          gradsync::CudaPowerSGD(config));
                body(backend, stream, model, dp);
            });
        };
        run([&](auto& backend, cudaStream_t stream, DeviceMatrices& model, auto& dp) {
            straight[std::size_t(backend.rank())] = train(backend, stream, model, dp, 0, 6);
        });
        run([&](auto& backend, cudaStream_t stream, DeviceMatrices& model, auto& dp) {
            (void)train(backend, stream, model, dp, 0, 3);
            gradsync::Checkpoint().add(dp.comm_hook()).save(path, dp);
        });
        CHECK(std::filesystem::exists(dir.path / "powersgd_device.safetensors.step-3.rank-1-of-2.safetensors"));
        run([&](auto& backend, cudaStream_t stream, DeviceMatrices& model, auto& dp) {
            gradsync::Checkpoint().add(dp.comm_hook()).load(path, dp);
            CHECK(dp.steps() == 3);
            resumed[std::size_t(backend.rank())] = train(backend, stream, model, dp, 3, 6);
        });
        run([&](auto& backend, cudaStream_t stream, DeviceMatrices& model, auto& dp) {
            unrestored[std::size_t(backend.rank())] = train(backend, stream, model, dp, 3, 6);
        });
        for (std::size_t r = 0; r < 2; ++r) {
            CAPTURE(r);
            CHECK(resumed[r] == straight[r]);
            CHECK(unrestored[r] != straight[r]);
        }
    }
}
