// Communication hooks on device memory: a hook that never reads the values itself (AllreduceHook)
// runs where the gradients lie, over the device backends with CudaMemory. float32 gradients end
// as without a hook, bit for bit; float16 and bfloat16 ones are averaged in float32 and rounded
// once, their float32 copy (float32_gradient) in device memory; the hook's collectives add no host
// wait to a step; ShardedDataParallel's shards through it are as without it. Suite "gpu": run on
// a GPU, and here on the stand-in CUDA runtime and NCCL (tests/standin).
#include <doctest/doctest.h>

#include <gradsync/backend/cuda_local.cuh>
#include <gradsync/backend/nccl.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/half.hpp>
#include <gradsync/launch/nccl_spawn.hpp>
#include <gradsync/memory/cuda.cuh>
#include <gradsync/sharded_data_parallel.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "device_support.cuh"

// The test's own kernel (declared in device_support.cuh), outside the anonymous namespace: the
// stand-in run registers a host reference for it (test_kernels_on_standin.cu).
namespace test_kernels {

__global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

}  // namespace test_kernels

using namespace device_test;

namespace {

constexpr float loss_scale = 256.0f;
const auto buckets =
    gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{16 << 10}, .first_cap = gradsync::Bytes{4 << 10}};

// Rank r's unscaled gradient of parameter i at element k: 10 significant bits (exact in float16)
// at magnitudes that differ between the ranks, so that their sums need more bits than 16 hold.
float gradient_value(std::size_t i, std::size_t k, std::size_t r, int step) {
    const int m = int((k * 7919 + i * 104729 + r * 31337 + std::size_t(step) * 7) % 2047) - 1023;
    return std::ldexp(float(m), -int((k + 3 * r) % 7) - 6);
}

// Parameters of T (float, float16 or bfloat16), each with its own device allocation.
template <class T>
struct DeviceModel {
    std::vector<std::size_t> sizes = {1000, 3, 7001};
    std::deque<DeviceArray<T>> weights, grads;  // not movable: a deque keeps each where it is made
    DeviceModel() {
        for (auto n : sizes) {
            weights.emplace_back(n);
            grads.emplace_back(n);
        }
    }
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        for (std::size_t i = 0; i < sizes.size(); ++i)
            out.push_back({"p" + std::to_string(i), weights[i].data, grads[i].data, sizes[i], gradsync::dtype_of<T>});
        return out;
    }
    // Rank r's gradients at `step`, times the loss scale, landed before the step's work.
    void set_gradients(cudaStream_t stream, std::size_t r, int step) {
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (std::size_t i = 0; i < sizes.size(); ++i) {
            std::vector<T> host(sizes[i]);
            for (std::size_t k = 0; k < sizes[i]; ++k) host[k] = T(gradient_value(i, k, r, step) * loss_scale);
            grads[i].upload(host);
        }
        GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
    }
};

template <class T>
std::vector<std::uint8_t> bytes_of(const std::vector<T>& v) {
    std::vector<std::uint8_t> out(v.size() * sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
    return out;
}

// What one rank ends with: each parameter's gradient (as bytes), each step's norm, and with a
// 16-bit model each parameter's float32 copy.
struct Ended {
    std::vector<std::vector<std::uint8_t>> grads;
    std::vector<double> norms;
    std::vector<std::vector<float>> float32;
};

// Two steps of DataParallel over `backend`, the second overlapped with backward (grad_ready, last
// parameter first), with the hook policies `hook...` (none or one).
template <class T, class B, class... Hook>
Ended train(B& backend, cudaStream_t stream, Hook... hook) {
    const auto r = std::size_t(backend.rank());
    DeviceModel<T> model;
    gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                              gradsync::StaticLossScale{.value = loss_scale}, buckets, hook...);
    Ended out;
    for (int step = 0; step < 2; ++step) {
        model.set_gradients(stream, r, step);
        if (step == 1)
            for (std::size_t i = model.sizes.size(); i-- > 0;) dp.grad_ready(i);
        const auto report = dp.step([] {});
        CHECK(report.applied);
        out.norms.push_back(report.grad_norm);
    }
    GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (std::size_t i = 0; i < model.sizes.size(); ++i) {
        out.grads.push_back(bytes_of(model.grads[i].download()));
        if constexpr (sizeof...(Hook) == 1 && sizeof(T) == 2) {
            const auto copy = dp.float32_gradient("p" + std::to_string(i));
            std::vector<float> host(copy.size());
            GRADSYNC_CUDA_CHECK(
                cudaMemcpy(host.data(), copy.data(), copy.size_bytes(), cudaMemcpyDeviceToHost));  // device memory
            out.float32.push_back(host);
        }
    }
    return out;
}

// float32 gradients through AllreduceHook on n ranks: every rank ends as without the hook, bit for
// bit, and alike.
template <class Spawn>
void check_float32_as_without_hook(int n, Spawn spawn) {
    std::vector<Ended> hooked(static_cast<std::size_t>(n)), plain(static_cast<std::size_t>(n));
    spawn(n, [&](auto& backend, cudaStream_t stream) {
        const auto r = std::size_t(backend.rank());
        plain[r] = train<float>(backend, stream);
        hooked[r] = train<float>(backend, stream, gradsync::AllreduceHook{});
    });
    for (std::size_t r = 0; r < std::size_t(n); ++r) {
        CAPTURE(r);
        CHECK(hooked[r].grads == plain[r].grads);
        CHECK(hooked[r].grads == hooked[0].grads);
        CHECK(std::memcmp(hooked[r].norms.data(), plain[r].norms.data(), 2 * sizeof(double)) == 0);
    }
}

// 16-bit gradients through AllreduceHook on n ranks (a power of two, so that the average of the
// float32 sum is exact): the float32 copy holds the ranks' average summed in float32, and the
// model's gradient is that average rounded once, on every rank. On more than 2 ranks a 16-bit sum
// would round at each addition and differ somewhere (on 2 there is one addition to round).
template <class T>
void check_16_bit_averaged_in_float32(int n) {
    std::vector<Ended> ended(static_cast<std::size_t>(n));
    on_cuda_local_with_stream(n, [&](gradsync::CudaLocalBackend& backend, cudaStream_t stream) {
        ended[std::size_t(backend.rank())] = train<T>(backend, stream, gradsync::AllreduceHook{});
    });
    const DeviceModel<T> shape;
    bool a_16_bit_sum_differs = false;
    for (std::size_t i = 0; i < shape.sizes.size(); ++i) {
        CAPTURE(i);
        std::vector<float> average(shape.sizes[i]);
        std::vector<T> rounded(shape.sizes[i]);
        for (std::size_t k = 0; k < shape.sizes[i]; ++k) {
            float sum = 0.0f;
            T sum16(0.0f);
            for (int r = 0; r < n; ++r) {
                const float v = float(T(gradient_value(i, k, std::size_t(r), 1) * loss_scale));
                sum += v;
                sum16 = T(float(sum16) + v);
            }
            average[k] = sum / float(n) / loss_scale;
            rounded[k] = T(average[k]);
            a_16_bit_sum_differs |= float(T(float(sum16) / float(n) / loss_scale)) != float(rounded[k]);
        }
        for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            CHECK(ended[std::size_t(r)].float32[i] == average);
            CHECK(ended[std::size_t(r)].grads[i] == bytes_of(rounded));
        }
    }
    if (n > 2) CHECK(a_16_bit_sum_differs);
}

// This rank's shard of each step's averaged gradient, as ShardedDataParallel's optimizer reads it
// (pieces in device memory), with the hook policies `hook...` (none or one), and each step's norm.
template <class B, class... Hook>
Ended shards_of(B& backend, cudaStream_t stream, Hook... hook) {
    const auto r = std::size_t(backend.rank());
    DeviceModel<float> model;
    gradsync::ShardedDataParallel sdp(model, backend, gradsync::CudaMemory{stream},
                                      gradsync::StaticLossScale{.value = loss_scale}, buckets, hook...);
    Ended out;
    for (int step = 0; step < 2; ++step) {
        model.set_gradients(stream, r, step);
        if (step == 1)
            for (std::size_t i = model.sizes.size(); i-- > 0;) sdp.grad_ready(i);
        const auto report = sdp.step([&](std::span<const gradsync::ShardPiece<float>> pieces) {
            GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
            for (const auto& piece : pieces) {
                std::vector<float> host(piece.grads.size());
                GRADSYNC_CUDA_CHECK(
                    cudaMemcpy(host.data(), piece.grads.data(), piece.grads.size_bytes(), cudaMemcpyDeviceToHost));
                out.grads.push_back(bytes_of(host));
            }
        });
        CHECK(report.applied);
        out.norms.push_back(report.grad_norm);
    }
    return out;
}

}  // namespace

TEST_SUITE("gpu") {
    TEST_CASE(
        "AllreduceHook on device memory (CudaLocalBackend, CudaMemory): float32 gradients end as without the hook, "
        "bit for bit, on 1 to 3 ranks, overlapped or not") {
        for (int n : {1, 2, 3}) {
            CAPTURE(n);
            check_float32_as_without_hook(n, [](int ranks, auto fn) { on_cuda_local_with_stream(ranks, fn); });
        }
    }

    TEST_CASE(
        "AllreduceHook on device memory (NcclBackend, one rank per GPU): float32 gradients end as without the hook, "
        "bit for bit") {
        check_float32_as_without_hook(gradsync::cuda_devices().count,
                                      [](int ranks, auto fn) { on_nccl_with_stream(ranks, fn); });
    }

    TEST_CASE(
        "AllreduceHook on device memory: float16 and bfloat16 gradients averaged in float32 and rounded once; "
        "float32_gradient is the float32 average, in device memory") {
        for (int n : {2, 4}) {
            CAPTURE(n);
            check_16_bit_averaged_in_float32<gradsync::float16>(n);
            check_16_bit_averaged_in_float32<gradsync::bfloat16>(n);
        }
    }

    TEST_CASE(
        "step_on_device with AllreduceHook (NcclBackend, one rank per GPU): the host waits for none of the hook's "
        "collectives") {
        const int n = gradsync::cuda_devices().count;
        if (n < 2) MESSAGE("one GPU: a world of one runs no hook, so this checks the step alone");
        // Whether the work queued before a step_on_device() on each rank (a kernel that spins for
        // about a second) was still running when it returned.
        const auto queued_work_running = [n](auto... hook) {
            std::vector<int> running(static_cast<std::size_t>(n), 0);
            on_nccl_with_stream(n, [&](gradsync::NcclBackend<>& backend, cudaStream_t stream) {
                const auto r = std::size_t(backend.rank());
                DeviceModel<gradsync::bfloat16> model;
                gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                                          gradsync::StaticLossScale{.value = loss_scale}, buckets,
                                          gradsync::Options{.check_histories = false}, hook...);
                model.set_gradients(stream, r, 0);
                running[r] = returns_while_queued_work_runs(
                    stream, [&] { dp.step_on_device([](const gradsync::StepVerdict*) {}); });
            });
            return running;
        };
        const std::vector<int> all(static_cast<std::size_t>(n), 1);
        CHECK(queued_work_running() == all);
        CHECK(queued_work_running(gradsync::AllreduceHook{}) == all);
    }

    TEST_CASE(
        "ShardedDataParallel with AllreduceHook on device memory (CudaLocalBackend, CudaMemory): each rank's shard "
        "of the average as without the hook, bit for bit, on 2 and 3 ranks") {
        for (int n : {2, 3}) {
            CAPTURE(n);
            std::vector<Ended> hooked(static_cast<std::size_t>(n)), plain(static_cast<std::size_t>(n));
            on_cuda_local_with_stream(n, [&](gradsync::CudaLocalBackend& backend, cudaStream_t stream) {
                const auto r = std::size_t(backend.rank());
                plain[r] = shards_of(backend, stream);
                hooked[r] = shards_of(backend, stream, gradsync::AllreduceHook{});
            });
            for (std::size_t r = 0; r < std::size_t(n); ++r) {
                CAPTURE(r);
                CHECK(!hooked[r].grads.empty());
                CHECK(hooked[r].grads == plain[r].grads);
                CHECK(std::memcmp(hooked[r].norms.data(), plain[r].norms.data(), 2 * sizeof(double)) == 0);
            }
        }
    }
}
