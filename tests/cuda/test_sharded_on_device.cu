// ShardedDataParallel with its shards in device memory (CudaMemory) over the device backends
// (CudaLocalBackend, NcclBackend), stage 1 and 2: the same weights, bit for bit, as DataParallel
// over the same backend with the same optimizer kernel; an overflow skips the step on every rank;
// a memory policy on another stream is refused alike on every rank. Suite "gpu": run on a GPU, and here on the
// stand-in CUDA runtime and NCCL (tests/standin).
#include <doctest/doctest.h>

#include <gradsync/backend/cuda_local.cuh>
#include <gradsync/backend/nccl.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/nccl_spawn.hpp>
#include <gradsync/memory/cuda.cuh>
#include <gradsync/sharded_data_parallel.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "device_support.cuh"

// The host waits the stand-in CUDA runtime has counted on this thread; null on a GPU.
extern "C" std::uint64_t gradsync_standin_host_waits() __attribute__((weak));

namespace test_kernels {

// An optimizer's kernel: p -= lr g over n elements (the stand-in runs its host reference).
__global__ void sgd(float* p, const float* g, std::size_t n, float lr) {
    for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
         i += std::size_t(gridDim.x) * blockDim.x)
        p[i] -= lr * g[i];
}

}  // namespace test_kernels

using namespace device_test;

namespace {

constexpr float learning_rate = 0.125f;
constexpr float loss_scale = 256.0f;
constexpr int steps = 3;

void sgd_on(cudaStream_t stream, float* p, const float* g, std::size_t n) {
    if (n == 0) return;
    const auto blocks = unsigned(std::min<std::size_t>((n + 255) / 256, 1024));
    test_kernels::sgd<<<blocks, 256, 0, stream>>>(p, g, n, learning_rate);
    GRADSYNC_CUDA_CHECK(cudaGetLastError());
}

// n values that depend on `seed` and on the element, none a multiple of another rank's.
std::vector<float> pattern(std::size_t n, std::size_t seed, float scale) {
    std::vector<float> out(n);
    for (std::size_t k = 0; k < n; ++k) out[k] = float(int((k * 7 + seed * 5) % 23) - 11) * scale;
    return out;
}

void upload(float* device, const std::vector<float>& host) {
    GRADSYNC_CUDA_CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    // A copy from pageable memory may land after cudaMemcpy returns, on the default stream, which
    // the trainer's non-blocking stream does not wait for.
    GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
}

std::vector<float> download(const float* device, std::size_t n) {
    std::vector<float> out(n);
    GRADSYNC_CUDA_CHECK(cudaMemcpy(out.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
}

// Rank r's weights before wrapping (rank 0's are every rank's after it).
void set_weights(ScatteredDeviceModel& model, std::size_t rank) {
    for (std::size_t i = 0; i < model.sizes.size(); ++i)
        upload(model.weights[i], pattern(model.sizes[i], 3 * i + rank + 1, 0.25f));
}
// Rank r's scaled gradients at step s (the micro-batch's, times the loss scale), written once the
// last step's work on the trainer's stream is done (backward would run on that stream itself).
void set_grads(ScatteredDeviceModel& model, cudaStream_t stream, std::size_t rank, int step) {
    GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (std::size_t i = 0; i < model.sizes.size(); ++i)
        upload(model.grads[i], pattern(model.sizes[i], 11 * i + 7 * rank + std::size_t(step), 0.5f * loss_scale));
}

std::vector<std::vector<float>> weights_of(const ScatteredDeviceModel& model, cudaStream_t stream) {
    GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<std::vector<float>> out;
    for (std::size_t i = 0; i < model.sizes.size(); ++i) out.push_back(download(model.weights[i], model.sizes[i]));
    return out;
}

const auto buckets =
    gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{64 << 10}, .first_cap = gradsync::Bytes{4 << 10}};

// Stage 2's model: more buckets than the three buffers lent to them in turn, and gradients
// released by filling them with NaN in stream order (where cudaFreeAsync would free them): a read
// of a released gradient would make the step overflow.
struct ReleasingDeviceModel : ScatteredDeviceModel {
    cudaStream_t stream;
    std::size_t releases = 0;
    ReleasingDeviceModel(cudaStream_t s, std::vector<std::size_t> sizes)
        : ScatteredDeviceModel(std::move(sizes)), stream(s) {}
    void release_gradients(std::span<const std::size_t> indices) {
        for (auto i : indices) GRADSYNC_CUDA_CHECK(cudaMemsetAsync(grads[i], 0xFF, sizes[i] * sizeof(float), stream));
        releases += indices.size();
    }
};

// How a test trains: the model's parameter sizes, the buckets, the sharded front's options.
struct Setup {
    std::vector<std::size_t> sizes = {1000, 3, 70000};
    gradsync::SizeCappedBuckets caps = buckets;
    gradsync::ShardedOptions options;
};

// What one rank ends with after `steps` steps of one front.
struct Run {
    std::vector<std::vector<float>> weights;
    std::vector<double> norms;
    std::size_t releases = 0;
    bool memory_as_documented = true;  // extra_memory() as the stage's buffers add up
};

// Stage 2 over a packed backend holds the parameters' packed copies, this rank's share of the
// gradients and three gradient buffers lent in turn to the buckets (more than three; bucket b
// borrows buffer b % 3, as large as the largest bucket it serves), and a little bookkeeping.
template <class Sdp>
bool stage2_memory_as_documented(const Sdp& sdp) {
    const auto& buckets = sdp.plan().buckets;
    std::size_t largest[3] = {0, 0, 0};
    for (std::size_t b = 0; b < buckets.size(); ++b) largest[b % 3] = std::max(largest[b % 3], buckets[b].count);
    const std::size_t lent = largest[0] + largest[1] + largest[2];
    const gradsync::Bytes held{(sdp.parameter_elements() + sdp.state_elements() + lent) * sizeof(float)};
    return buckets.size() > 3 && lent < sdp.parameter_elements() && sdp.extra_memory() >= held &&
           sdp.extra_memory() < held + gradsync::Bytes{1 << 10};
}

// Sharded: the optimizer kernel on this rank's pieces, in device memory, on the trainer's stream;
// the second step's buckets launched during backward (grad_ready, last parameter first).
template <class B>
Run train_sharded(B& backend, cudaStream_t stream, const Setup& setup) {
    const auto r = std::size_t(backend.rank());
    ReleasingDeviceModel model(stream, setup.sizes);
    set_weights(model, r);
    gradsync::ShardedDataParallel sdp(model, backend, gradsync::CudaMemory{stream},
                                      gradsync::StaticLossScale{.value = loss_scale}, setup.caps, setup.options);
    Run run;
    if (setup.options.release_gradients) run.memory_as_documented = stage2_memory_as_documented(sdp);
    for (int s = 0; s < steps; ++s) {
        set_grads(model, stream, r, s);
        if (s == 1)
            for (std::size_t i = model.sizes.size(); i-- > 0;) sdp.grad_ready(i);
        const auto report = sdp.step([&](std::span<const gradsync::ShardPiece<float>> pieces) {
            for (const auto& piece : pieces)
                sgd_on(stream, piece.params.data(), piece.grads.data(), piece.params.size());
        });
        CHECK(report.applied);
        run.norms.push_back(report.grad_norm);
    }
    run.weights = weights_of(model, stream);
    run.releases = model.releases;
    return run;
}

// Unsharded: the same kernel on every whole parameter, on every rank.
template <class B>
Run train_unsharded(B& backend, cudaStream_t stream, const Setup& setup) {
    const auto r = std::size_t(backend.rank());
    ScatteredDeviceModel model(setup.sizes);
    set_weights(model, r);
    gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                              gradsync::StaticLossScale{.value = loss_scale}, setup.caps);
    Run run;
    for (int s = 0; s < steps; ++s) {
        set_grads(model, stream, r, s);
        const auto report = dp.step([&] {
            for (std::size_t i = 0; i < model.sizes.size(); ++i)
                sgd_on(stream, model.weights[i], model.grads[i], model.sizes[i]);
        });
        CHECK(report.applied);
        run.norms.push_back(report.grad_norm);
    }
    run.weights = weights_of(model, stream);
    return run;
}

// n ranks (started by spawn(n, fn), each with its backend) train both fronts: every rank's sharded
// weights are bitwise its unsharded ones where the backend sums alike in both collectives
// (`bitwise`), else equal to float precision; every rank alike; the norms equal up to summation
// order. Stage 2 (`setup.options`): every gradient released once a step, the memory as documented.
template <class Spawn>
void check_sharded_equals_unsharded(int n, bool bitwise, Spawn spawn, const Setup& setup = {}) {
    std::vector<Run> sharded(static_cast<std::size_t>(n)), plain(static_cast<std::size_t>(n));
    spawn(n, [&](auto& backend) {
        const auto r = std::size_t(backend.rank());
        const Stream stream;
        backend.set_compute_stream(stream);
        plain[r] = train_unsharded(backend, stream, setup);
        sharded[r] = train_sharded(backend, stream, setup);
    });
    for (std::size_t r = 0; r < std::size_t(n); ++r) {
        CAPTURE(r);
        for (std::size_t i = 0; i < sharded[r].weights.size(); ++i) {
            CAPTURE(i);
            const auto& got = sharded[r].weights[i];
            const auto& want = plain[r].weights[i];
            CHECK(same_bytes(got, sharded[0].weights[i]));
            if (bitwise) {
                CHECK(same_bytes(got, want));
            } else {
                for (std::size_t k = 0; k < got.size(); ++k)
                    if (got[k] != doctest::Approx(want[k]).epsilon(1e-5)) {
                        FAIL_CHECK("element ", k, ": ", got[k], " != ", want[k]);
                        break;
                    }
            }
        }
        for (int s = 0; s < steps; ++s)
            CHECK(sharded[r].norms[std::size_t(s)] == doctest::Approx(plain[r].norms[std::size_t(s)]).epsilon(1e-12));
        CHECK(sharded[r].releases == (setup.options.release_gradients ? setup.sizes.size() * steps : 0));
        CHECK(sharded[r].memory_as_documented);
    }
}

// Stage 2 on the device: more buckets than lent buffers.
const Setup stage2{.sizes = {1000, 3, 70000, 5000, 17, 20000, 9000, 64},
                   .caps = {.cap = gradsync::Bytes{16 << 10}, .first_cap = gradsync::Bytes{4 << 10}},
                   .options = {.release_gradients = true}};

template <class Body>
void on_cuda_local(int n, Body&& body) {
    gradsync::cuda_local_spawn(n, [&](gradsync::CudaLocalBackend& backend) { body(backend); });
}
template <class Body>
void on_nccl(int n, Body&& body) {
    gradsync::nccl_spawn(n, [&](gradsync::NcclBackend<>& backend) { body(backend); });
}

// What every rank's wrapping threw (empty: nothing).
template <class Spawn, class Wrap>
std::vector<std::string> refusals(int n, Spawn spawn, Wrap wrap) {
    std::vector<std::string> out(static_cast<std::size_t>(n));
    spawn(n, [&](auto& backend) {
        const Stream stream;
        backend.set_compute_stream(stream);
        ScatteredDeviceModel model;
        try {
            wrap(model, backend, stream);
        } catch (const std::exception& e) {
            out[std::size_t(backend.rank())] = e.what();
        }
    });
    return out;
}

}  // namespace

// Every member of ShardedDataParallel over the device backends with CudaMemory compiles.
template class gradsync::ShardedDataParallel<ScatteredDeviceModel, gradsync::NcclBackend<>, gradsync::CudaMemory>;
template class gradsync::ShardedDataParallel<ScatteredDeviceModel, gradsync::CudaLocalBackend, gradsync::CudaMemory>;
template class gradsync::ShardedDataParallel<ReleasingDeviceModel, gradsync::NcclBackend<>, gradsync::CudaMemory>;

TEST_SUITE("gpu") {
    TEST_CASE(
        "ShardedDataParallel<CudaLocalBackend, CudaMemory>: 1 to 4 ranks on one GPU end with DataParallel's "
        "weights bit for bit, the optimizer's kernel on pieces in device memory, overlapped or not") {
        for (int n : {1, 2, 3, 4}) {
            CAPTURE(n);
            check_sharded_equals_unsharded(n, true, [](int ranks, auto fn) { on_cuda_local(ranks, fn); });
        }
    }

    TEST_CASE(
        "ShardedDataParallel<CudaLocalBackend, CudaMemory> with released gradients (stage 2): 1 to 4 ranks end with "
        "DataParallel's weights bit for bit, each gradient released once a step in stream order, three buffers lent "
        "to the buckets in turn") {
        for (int n : {1, 2, 3, 4}) {
            CAPTURE(n);
            check_sharded_equals_unsharded(
                n, true, [](int ranks, auto fn) { on_cuda_local(ranks, fn); }, stage2);
        }
    }

    TEST_CASE(
        "ShardedDataParallel<NcclBackend, CudaMemory>, one rank per GPU (nccl_spawn): DataParallel's weights, "
        "bit for bit where NCCL's reduce-scatter sums as its allreduce does") {
        const int n = gradsync::cuda_devices().count;
        // The stand-in sums in rank order in both; NCCL on 1 or 2 GPUs has one order to sum in.
        const bool bitwise = gradsync_standin_host_waits != nullptr || n <= 2;
        check_sharded_equals_unsharded(n, bitwise, [](int ranks, auto fn) { on_nccl(ranks, fn); });
        check_sharded_equals_unsharded(
            n, bitwise, [](int ranks, auto fn) { on_nccl(ranks, fn); }, stage2);
    }

    TEST_CASE(
        "ShardedDataParallel on the device: a gradient that overflows on one rank skips the step on every rank, "
        "names the parameter and leaves the weights; the next step applies") {
        const int n = 3;
        std::vector<std::vector<std::vector<float>>> before(n), after(n);
        std::vector<std::vector<std::string>> named(n);
        std::vector<int> applied(n, 0);
        on_cuda_local(n, [&](gradsync::CudaLocalBackend& backend) {
            const auto r = std::size_t(backend.rank());
            const Stream stream;
            backend.set_compute_stream(stream);
            ScatteredDeviceModel model;
            set_weights(model, r);
            gradsync::ShardedDataParallel sdp(model, backend, gradsync::CudaMemory{stream}, buckets,
                                              gradsync::StaticLossScale{.value = loss_scale});
            const auto optimizer = [&](std::span<const gradsync::ShardPiece<float>> pieces) {
                for (const auto& piece : pieces)
                    sgd_on(stream, piece.params.data(), piece.grads.data(), piece.params.size());
            };
            before[r] = weights_of(model, stream);
            set_grads(model, stream, r, 0);
            if (r == 1) upload(model.grads[2] + 5, {INFINITY});
            auto report = sdp.step(optimizer);
            named[r] = report.overflowed;
            after[r] = weights_of(model, stream);
            set_grads(model, stream, r, 1);
            report = sdp.step(optimizer);
            applied[r] = report.applied ? 1 : 0;
        });
        for (std::size_t r = 0; r < std::size_t(n); ++r) {
            CAPTURE(r);
            CHECK(named[r] == std::vector<std::string>{"p2"});
            for (std::size_t i = 0; i < 3; ++i) CHECK(same_bytes(after[r][i], before[0][i]));
            CHECK(applied[r] == 1);
        }
    }

    TEST_CASE(
        "ShardedDataParallel on the device refuses alike on every rank a memory policy on another stream than "
        "the backend's") {
        const Stream other;
        const auto streams = refusals(
            2, [](int ranks, auto fn) { on_cuda_local(ranks, fn); },
            [&](ScatteredDeviceModel& model, auto& backend, cudaStream_t) {
                gradsync::ShardedDataParallel sdp(model, backend, gradsync::CudaMemory{other});
            });
        for (std::size_t r = 0; r < 2; ++r) {
            CAPTURE(r);
            CHECK(streams[r].find("is not the backend's compute stream") != std::string::npos);
            CHECK(streams[r] == streams[0]);
        }
    }
}
