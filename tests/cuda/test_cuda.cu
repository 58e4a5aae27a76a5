// The CUDA path. Two suites in one executable, compiled once by nvcc: "host" runs anywhere (error
// reporting, device discovery), "gpu" needs a CUDA device and, without one, reports
// "skipped: no CUDA device" (ctest marks it skipped). bench/gpu-check.sh runs both on a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <gradsync/backend/nccl.hpp>
#include <gradsync/launch/nccl_spawn.hpp>
#include <gradsync/model/contiguous_parameters.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/memory/cuda/finalize.cuh>
#include <gradsync/backend/cuda_local.cuh>
#include <gradsync/memory/cuda.cuh>
#include <gradsync/memory/cuda/pack.cuh>
#include <gradsync/detail/host_passes.hpp>
#include <gradsync/detail/host_reduce.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>  // for setenv
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../support/generic_trainer.hpp"
#include "device_support.cuh"

using namespace device_test;

// The host waits the stand-in CUDA runtime has counted on this thread (tests/standin), where the
// test is linked against it; null on a GPU, where nothing counts them.
extern "C" std::uint64_t gradsync_standin_host_waits() __attribute__((weak));

// A trainer's collective calls, written once, compile against the device backends as against
// LocalBackend and MpiBackend (where the tests run them).
template void generic::collective_step<gradsync::NcclBackend<>>(gradsync::NcclBackend<>&, std::span<float>,
                                                                std::span<double>, std::span<gradsync::float16>,
                                                                std::span<std::int64_t>);
template void generic::collective_step<gradsync::CudaLocalBackend>(gradsync::CudaLocalBackend&, std::span<float>,
                                                                   std::span<double>, std::span<gradsync::float16>,
                                                                   std::span<std::int64_t>);

namespace {

// Packs tensors of the given sizes (one element of slack before each, so that most start
// unaligned) into a bucket on the device and back, against the host's copy.
template <class T>
void check_pack_round_trip(const std::vector<std::size_t>& sizes) {
    std::size_t storage = 0;
    for (auto n : sizes) storage += n + 1;
    std::vector<T> host(storage);
    std::mt19937 rng(11);
    for (auto& v : host) {
        const auto bits = rng();
        std::memcpy(&v, &bits, std::min(sizeof v, sizeof bits));
    }
    DeviceArray<T> tensors(storage);
    tensors.upload(host);
    std::vector<gradsync::cuda::Segment> table;
    std::vector<T> expected;
    std::size_t at = 0;
    for (auto n : sizes) {
        ++at;  // the slack element
        table.push_back({tensors.data + at, n, expected.size()});
        expected.insert(expected.end(), host.begin() + std::ptrdiff_t(at), host.begin() + std::ptrdiff_t(at + n));
        at += n;
    }
    DeviceArray<gradsync::cuda::Segment> device_table(table.size());
    device_table.upload(table);
    DeviceArray<T> bucket(expected.size());
    gradsync::cuda::pack<T>({device_table.data, device_table.size}, bucket.data, expected.size(), nullptr);
    GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
    const auto packed = bucket.download();
    CHECK(same_bytes(packed, expected));

    // Unpack a changed bucket: the tensors take its values, the slack elements keep theirs.
    std::vector<T> changed(expected.size());
    for (auto& v : changed) {
        const auto bits = rng();
        std::memcpy(&v, &bits, std::min(sizeof v, sizeof bits));
    }
    bucket.upload(changed);
    gradsync::cuda::unpack<T>({device_table.data, device_table.size}, bucket.data, changed.size(), nullptr);
    GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
    auto after = tensors.download();
    std::vector<T> want = host;
    std::size_t k = 0;
    for (const auto& s : table) {
        const std::size_t first = std::size_t(static_cast<T*>(s.data) - tensors.data);
        for (std::size_t i = 0; i < s.count; ++i) want[first + i] = changed[k++];
    }
    CHECK(same_bytes(after, want));
}

template <class T>
void check_pack_sizes() {
    check_pack_round_trip<T>({});
    check_pack_round_trip<T>({0});
    check_pack_round_trip<T>({1});
    check_pack_round_trip<T>({0, 3, 0, 1, 8191, 8192, 8193});
    std::vector<std::size_t> many(2000, 7);  // many small tensors, one launch
    check_pack_round_trip<T>(many);
    check_pack_round_trip<T>({std::size_t(3) << 20});  // one tensor over many blocks
    // Tensors 3 and 7 lie 4 and 8 elements off their bucket position: 16 bytes for float and
    // double, and for 16-bit values at tensor 7, so those pieces move 16 bytes at a time, after a
    // head of single elements; a tail follows.
    check_pack_round_trip<T>({1, 1, 1, 100'003, 1, 1, 1, 100'005});
}

// The device pass against the host's (detail/finalize.hpp): the same values written, bit for bit,
// and the same sum of squares up to summation order; the same sum again on a second run.
template <class T>
void check_finalize(std::size_t n, double factor, bool poison = false) {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> value(-4.0f, 4.0f);
    std::vector<T> host(n);
    for (auto& v : host) v = T(value(rng));
    if (poison && n > 0) host[n / 2] = T(INFINITY);
    std::vector<T> expected = host;
    gradsync::detail::SquareSum sums;
    gradsync::detail::scale_square_sum(expected.data(), n, factor, sums);

    gradsync::cuda::FinalizeScratch scratch;
    DeviceArray<T> data(n);
    double sum[2] = {};
    for (double& s : sum) {
        data.upload(host);
        gradsync::cuda::finalize<T>(data.data, n, factor, scratch, nullptr);
        GRADSYNC_CUDA_CHECK(cudaMemcpy(&s, scratch.sum(), sizeof s, cudaMemcpyDeviceToHost));
    }
    const auto written = data.download();
    CHECK(same_bytes(written, expected));
    if (poison) {
        CHECK_FALSE(std::isfinite(sum[0]));
    } else {
        CHECK(sum[0] == doctest::Approx(sums.total()).epsilon(1e-12));
    }
    CHECK(std::memcmp(&sum[0], &sum[1], sizeof(double)) == 0);  // deterministic
}

template <class T>
void check_finalize_sizes() {
    for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(255), std::size_t(256), std::size_t(257),
                          (std::size_t(1) << 20) + 3}) {
        CAPTURE(n);
        check_finalize<T>(n, 1.0 / 6.0);
        check_finalize<T>(n, 1.0);
    }
    check_finalize<T>(100'000, 0.5, /*poison=*/true);
}

// World of one: every allreduce leaves the values as they are (average) or scaled (pre-multiplied
// sum); checked for one dtype, on device memory, with the result read back.
template <class T>
void check_world_of_one(gradsync::NcclBackend<>& backend, gradsync::DType dtype) {
    std::vector<T> host(1000);
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = T(float(i % 97) - 48.0f);
    DeviceArray<T> data(host.size());
    data.upload(host);
    gradsync::Buffer buf{data.data, data.size, dtype};
    backend.allreduce_async(buf, gradsync::ReduceOp::average).wait();
    CHECK(same_bytes(data.download(), host));
    backend.allreduce(buf, gradsync::ReduceOp::sum);
    CHECK(same_bytes(data.download(), host));
    backend.allreduce_scaled_async(buf, 0.25).wait();  // a power of two: exact
    std::vector<T> quarter = host;
    for (auto& v : quarter) v = T(float(v) * 0.25f);
    CHECK(same_bytes(data.download(), quarter));
}

// n ranks on one GPU each allreduce `count` values of T (rank-dependent), against the host's
// rank-order reduction of the same inputs: bitwise, on every rank.
// n ranks' inputs of `count` values of T (rank-dependent), and their average as the host reduces
// it (in rank order, in the accumulator type).
template <class T>
struct RankInputs {
    RankInputs(int n, std::size_t count) : inputs(static_cast<std::size_t>(n)), average(count) {
        for (int r = 0; r < n; ++r)
            for (std::size_t i = 0; i < count; ++i)
                inputs[std::size_t(r)].push_back(T(float(int(i % 29) - 14) * 0.37f + float(r)));
        std::vector<T*> pointers;
        for (auto& in : inputs) pointers.push_back(in.data());
        T* out = average.data();
        using A = gradsync::detail::accumulator_t<T>;
        gradsync::detail::AlignedBytes scratch(gradsync::detail::reduce_block_bytes);
        gradsync::detail::reduce_to_all<T>(pointers.data(), n, &out, 1, count, true, A(1) / A(n), scratch.data());
    }
    std::vector<std::vector<T>> inputs;
    std::vector<T> average;
};

template <class T>
void check_local_allreduce(int n, gradsync::DType dtype, std::size_t count) {
    const RankInputs<T> given(n, count);
    const auto& inputs = given.inputs;
    const auto& expected = given.average;
    std::vector<std::vector<T>> results(static_cast<std::size_t>(n));
    gradsync::cuda_local_spawn(n, [&](gradsync::CudaLocalBackend& backend) {
        const auto r = std::size_t(backend.rank());
        DeviceArray<T> data(count);
        data.upload(inputs[r]);
        backend.allreduce(gradsync::Buffer{data.data, count, dtype}, gradsync::ReduceOp::average);
        results[r] = data.download();
    });
    for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        CHECK(same_bytes(results[std::size_t(r)], expected));
    }
}

// reduce_scatter on CudaLocalBackend: each rank's shard is bitwise LocalBackend's rank-ordered
// average there and the rest of its buffer untouched; the all_gather then completes every rank's
// buffer to the whole result. On the device, and in host memory.
template <class T>
void check_local_sharded(int n, gradsync::DType dtype, std::size_t count, bool on_device) {
    const RankInputs<T> given(n, count);
    const auto& inputs = given.inputs;
    const auto& expected = given.average;
    std::vector<std::vector<T>> scattered(static_cast<std::size_t>(n)), gathered(static_cast<std::size_t>(n));
    gradsync::cuda_local_spawn(n, [&](gradsync::CudaLocalBackend& backend) {
        const auto r = std::size_t(backend.rank());
        if (on_device) {
            DeviceArray<T> data(count);
            data.upload(inputs[r]);
            backend.reduce_scatter(gradsync::Buffer{data.data, count, dtype}, gradsync::ReduceOp::average);
            scattered[r] = data.download();
            backend.all_gather(gradsync::Buffer{data.data, count, dtype});
            gathered[r] = data.download();
        } else {
            auto data = inputs[r];
            backend.reduce_scatter(gradsync::Buffer{data.data(), count, dtype}, gradsync::ReduceOp::average);
            scattered[r] = data;
            backend.all_gather(gradsync::Buffer{data.data(), count, dtype});
            gathered[r] = data;
        }
    });
    for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        const auto shard = gradsync::shard_of(count, n, r);
        auto want = inputs[std::size_t(r)];
        std::copy(expected.begin() + std::ptrdiff_t(shard.offset),
                  expected.begin() + std::ptrdiff_t(shard.offset + shard.count),
                  want.begin() + std::ptrdiff_t(shard.offset));
        CHECK(same_bytes(scattered[std::size_t(r)], want));
        CHECK(same_bytes(gathered[std::size_t(r)], expected));
    }
}

}  // namespace

// The test's own kernels, outside the anonymous namespace: the stand-in run registers host
// references for them (test_kernels_on_standin.cu).
namespace test_kernels {

// Spins for about `cycles` clock cycles, then writes `value` everywhere: a gradient that is
// written late on its stream.
__global__ void late_fill(float* data, std::size_t n, float value, long long cycles) {
    if (threadIdx.x == 0) {
        const long long start = clock64();
        while (clock64() - start < cycles) {
        }
    }
    __syncthreads();
    for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
         i += std::size_t(gridDim.x) * blockDim.x)
        data[i] = value;
}

// An optimizer's kernel under step_on_device: counts the step only when the verdict allows it.
__global__ void count_if_finite(const gradsync::StepVerdict* verdict, int* applied) {
    if (verdict->finite != 0) ++*applied;
}

__global__ void add_one(float* data, std::size_t n) {
    for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
         i += std::size_t(gridDim.x) * blockDim.x)
        data[i] += 1.0f;
}

}  // namespace test_kernels

using test_kernels::add_one;
using test_kernels::count_if_finite;
using test_kernels::late_fill;

namespace {

// n ranks (started by spawn(n, fn), each with its backend) train DataParallel with CudaMemory for
// two steps on gradients (r + 1) g, p2's written late on the rank's stream: every rank ends with
// the mean (n + 1) / 2 g, bit for bit alike, and the same norm.
template <class Spawn>
void check_mean_over_ranks(int n, Spawn spawn) {
    std::vector<std::vector<std::vector<float>>> grads(static_cast<std::size_t>(n));
    std::vector<double> norms(static_cast<std::size_t>(n));
    spawn(n, [&](auto& backend) {
        const auto r = std::size_t(backend.rank());
        const Stream stream;
        backend.set_compute_stream(stream);
        ScatteredDeviceModel model;
        gradsync::DataParallel dp(
            model, backend, gradsync::CudaMemory{stream}, gradsync::StaticLossScale{.value = 256.0f},
            gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{64 << 10}, .first_cap = gradsync::Bytes{4 << 10}});
        for (int step = 0; step < 2; ++step) {
            model.fill(256.0f * float(r + 1));  // rank r's micro-batch gradient: (r + 1) g
            GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
            // Backward, last parameter first; p2's gradient is written late on the stream.
            late_fill<<<64, 256, 0, stream>>>(model.grads[2], model.sizes[2], 256.0f * float(r + 1), 50'000'000LL);
            for (std::size_t i = model.sizes.size(); i-- > 0;) dp.grad_ready(i);
            const auto report = dp.step([] {});
            CHECK(report.applied);
            norms[r] = report.grad_norm;
        }
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (std::size_t i = 0; i < model.sizes.size(); ++i) grads[r].push_back(model.grad(i));
    });
    // The whole batch's gradient: the mean of (r + 1) g over the ranks, (n + 1) / 2 g.
    const float mean = float(n + 1) / 2.0f;
    for (std::size_t i = 0; i < 3; ++i) {
        const auto& g = grads[0][i];
        for (std::size_t k = 0; k < g.size(); ++k) {
            const float want = i == 2 ? mean : (float(k % 17) - 8.0f) * mean;
            if (g[k] != doctest::Approx(want).epsilon(1e-6)) {
                FAIL_CHECK("parameter ", i, " element ", k, ": ", g[k], " != ", want);
                break;
            }
        }
        for (int r = 1; r < n; ++r) CHECK(same_bytes(grads[std::size_t(r)][i], g));
    }
    for (int r = 1; r < n; ++r) CHECK(std::memcmp(&norms[std::size_t(r)], &norms[0], sizeof(double)) == 0);
}

}  // namespace

// Every member of DataParallel over NcclBackend with CudaMemory compiles.
template class gradsync::DataParallel<ScatteredDeviceModel, gradsync::NcclBackend<>, gradsync::CudaMemory>;

TEST_SUITE("host") {
    TEST_CASE("a failed CUDA call is a CudaError naming the call, the place and CUDA's words") {
        std::string what;
        cudaError_t code = cudaSuccess;
        try {
            GRADSYNC_CUDA_CHECK(cudaSetDevice(-1));
        } catch (const gradsync::CudaError& e) {
            what = e.what();
            code = e.code();
        }
        CHECK(code != cudaSuccess);
        CHECK(what.find("gradsync: cudaSetDevice(-1) failed at ") != std::string::npos);
        CHECK(what.find("test_cuda.cu:") != std::string::npos);
        CHECK(what.find(cudaGetErrorName(code)) != std::string::npos);
    }

    TEST_CASE("cuda_devices: a count, or zero with the reason") {
        const auto devices = gradsync::cuda_devices();
        CHECK(devices.count >= 0);
        if (devices.count == 0) CHECK(devices.why.find("no CUDA device") == 0);
        if (devices.count > 0) CHECK(devices.why.empty());
    }
}

TEST_SUITE("gpu") {
    TEST_CASE("pack and unpack: one launch per bucket, every element size, awkward sizes, unaligned tensors") {
        check_pack_sizes<std::uint16_t>();  // float16, bfloat16
        check_pack_sizes<float>();
        check_pack_sizes<double>();
    }

    TEST_CASE("finalize: scale in place and sum of squares in one pass, as the host does, deterministic") {
        check_finalize_sizes<float>();
        check_finalize_sizes<double>();
        check_finalize_sizes<gradsync::float16>();
        check_finalize_sizes<gradsync::bfloat16>();
    }

    TEST_CASE("pack, unpack and finalize beyond 2^31 bytes (when the GPU has the memory)") {
        std::size_t free_bytes = 0, total_bytes = 0;
        GRADSYNC_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
        const std::size_t n = (std::size_t(1) << 29) + 77;  // floats: 2 GiB + 308 bytes
        if (free_bytes < 3 * n * sizeof(float) + (std::size_t(1) << 30)) {
            MESSAGE("skipped: needs ", 3 * n * sizeof(float) >> 20, " MiB of free device memory");
            return;
        }
        DeviceArray<float> tensors(n + 1), bucket(n);
        GRADSYNC_CUDA_CHECK(cudaMemset(tensors.data, 0, (n + 1) * sizeof(float)));
        const float marks[3] = {1.5f, -2.5f, 4.0f};
        const std::size_t at[3] = {1, n / 2 + 3, n};  // the last beyond 2^31 bytes
        for (int k = 0; k < 3; ++k)
            GRADSYNC_CUDA_CHECK(cudaMemcpy(tensors.data + at[k], &marks[k], sizeof(float), cudaMemcpyHostToDevice));
        std::vector<gradsync::cuda::Segment> table = {{tensors.data + 1, n, 0}};  // unaligned by one element
        DeviceArray<gradsync::cuda::Segment> device_table(1);
        device_table.upload(table);
        gradsync::cuda::pack<float>({device_table.data, 1}, bucket.data, n, nullptr);
        float got[3] = {};
        for (int k = 0; k < 3; ++k)
            GRADSYNC_CUDA_CHECK(cudaMemcpy(&got[k], bucket.data + at[k] - 1, sizeof(float), cudaMemcpyDeviceToHost));
        CHECK(got[0] == 1.5f);
        CHECK(got[1] == -2.5f);
        CHECK(got[2] == 4.0f);
        gradsync::cuda::FinalizeScratch scratch;
        gradsync::cuda::finalize<float>(bucket.data, n, 0.5, scratch, nullptr);
        double sum = 0;
        GRADSYNC_CUDA_CHECK(cudaMemcpy(&sum, scratch.sum(), sizeof sum, cudaMemcpyDeviceToHost));
        CHECK(sum == 0.75 * 0.75 + 1.25 * 1.25 + 2.0 * 2.0);
        gradsync::cuda::unpack<float>({device_table.data, 1}, bucket.data, n, nullptr);
        GRADSYNC_CUDA_CHECK(cudaMemcpy(&got[2], tensors.data + n, sizeof(float), cudaMemcpyDeviceToHost));
        CHECK(got[2] == 2.0f);
    }

    TEST_CASE("NcclBackend, a world of one: every float dtype on the device, host buffers staged, broadcast") {
        const ncclUniqueId id = nccl_id();
        gradsync::NcclBackend<> backend(0, 1, 0, id);
        CHECK(backend.rank() == 0);
        CHECK(backend.size() == 1);
        check_world_of_one<float>(backend, gradsync::DType::float32);
        check_world_of_one<double>(backend, gradsync::DType::float64);
        check_world_of_one<gradsync::float16>(backend, gradsync::DType::float16);
        check_world_of_one<gradsync::bfloat16>(backend, gradsync::DType::bfloat16);

        std::vector<double> host = {1.5, -2.0, 3.25};  // host memory: staged through the device
        backend.allreduce(gradsync::Buffer{host.data(), host.size(), gradsync::DType::float64},
                          gradsync::ReduceOp::average);
        CHECK(host == std::vector<double>{1.5, -2.0, 3.25});
        std::vector<std::byte> bytes(100, std::byte{7});
        backend.broadcast(bytes, 0);
        CHECK(bytes == std::vector<std::byte>(100, std::byte{7}));
        backend.barrier();

        // A stream of the caller's waits for a collective without the host waiting.
        DeviceArray<float> data(1 << 20);
        auto handle = backend.allreduce_async(gradsync::Buffer{data.data, data.size, gradsync::DType::float32},
                                              gradsync::ReduceOp::average);
        const Stream mine;
        handle.then(mine);
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(mine));
        CHECK(handle.ready());

        CHECK_THROWS_AS(
            backend.allreduce(gradsync::Buffer{data.data, 1, gradsync::DType::int32}, gradsync::ReduceOp::sum),
            gradsync::CollectiveError);
        backend.abort("gradsync: rank 0: aborted by the test");
        CHECK_THROWS_WITH_AS(backend.barrier(), "gradsync: rank 0: aborted by the test", gradsync::CollectiveError);
    }

    TEST_CASE(
        "NcclBackend: a collective reduces what the compute stream wrote before it was queued, however "
        "late, and the compute stream's next work sees the result, and the host waits for neither") {
        const ncclUniqueId id = nccl_id();
        const Stream compute;
        gradsync::NcclBackend<> backend(0, 1, 0, id, gradsync::NcclOptions{.compute_stream = compute});
        constexpr std::size_t n = 1 << 20;
        DeviceArray<float> grad(n);
        GRADSYNC_CUDA_CHECK(cudaMemset(grad.data, 0, n * sizeof(float)));
        GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
        late_fill<<<64, 256, 0, compute>>>(grad.data, n, 2.0f, 200'000'000LL);  // ~0.1 s
        auto handle = backend.allreduce_scaled_async(gradsync::Buffer{grad.data, n, gradsync::DType::float32}, 0.5);
        backend.wait_on_device(handle);
        add_one<<<64, 256, 0, compute>>>(grad.data, n);
        CHECK(cudaStreamQuery(compute) == cudaErrorNotReady);  // the host queued it all without waiting
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(compute));
        // 2 * 0.5 + 1. Reduced before the write: 3; added before the reduction: 1.5.
        const auto result = grad.download();
        CHECK(std::count(result.begin(), result.end(), 2.0f) == std::ptrdiff_t(n));
        CHECK(handle.ready());
    }

    TEST_CASE(
        "DataParallel<NcclBackend, CudaMemory>, a world of one: step() unscales on the device and measures "
        "the norm as the host does, names a parameter that overflowed and skips the step, clips") {
        const ncclUniqueId id = nccl_id();
        const Stream stream;
        {
            gradsync::NcclBackend<> backend(0, 1, 0, id, gradsync::NcclOptions{.compute_stream = stream});
            ScatteredDeviceModel model;
            gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                                      gradsync::StaticLossScale{.value = 1024.0f});
            // Scaled gradients in, unscaled out: exact (a power of two); the norm as the host sums it.
            auto host = model.fill(1024.0f);
            int applied = 0;
            auto report = dp.step([&] { ++applied; });
            CHECK(report.applied);
            CHECK(applied == 1);
            double squares = 0;
            for (std::size_t i = 0; i < host.size(); ++i) {
                const auto g = model.grad(i);
                for (std::size_t k = 0; k < g.size(); ++k) {
                    CHECK_MESSAGE(g[k] == host[i][k] / 1024.0f, "parameter ", i, " element ", k);
                    if (g[k] != host[i][k] / 1024.0f) break;
                    squares += double(g[k]) * double(g[k]);
                }
            }
            CHECK(report.grad_norm == doctest::Approx(std::sqrt(squares)).epsilon(1e-12));

            // An infinity in p2: the step is skipped and p2 is named.
            model.fill(1024.0f);
            const float inf = INFINITY;
            GRADSYNC_CUDA_CHECK(cudaMemcpy(model.grads[2] + 5, &inf, sizeof inf, cudaMemcpyHostToDevice));
            GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the step
            report = dp.step([&] { ++applied; });
            CHECK_FALSE(report.applied);
            CHECK(applied == 1);
            CHECK(report.overflowed == std::vector<std::string>{"p2"});
        }
        {
            // A communicator of its own: an NCCL id serves one initialization only.
            gradsync::NcclBackend<> backend(0, 1, 0, nccl_id(), gradsync::NcclOptions{.compute_stream = stream});
            ScatteredDeviceModel model;
            gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                                      gradsync::Options{.clip_norm = 1.0});
            model.fill(1.0f);
            auto report = dp.step([] {});
            CHECK(report.clipped);
            GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));  // clipping is queued on the stream
            double squares = 0;
            for (std::size_t i = 0; i < model.sizes.size(); ++i)
                for (float v : model.grad(i)) squares += double(v) * double(v);
            CHECK(std::sqrt(squares) == doctest::Approx(1.0).epsilon(1e-5));
        }
    }

    TEST_CASE("CudaLocalBackend: 2 to 4 ranks on one GPU reduce as LocalBackend does, bit for bit, every dtype") {
        for (int n : {2, 3, 4}) {
            CAPTURE(n);
            check_local_allreduce<float>(n, gradsync::DType::float32, 100'003);
            check_local_allreduce<double>(n, gradsync::DType::float64, 4097);
            check_local_allreduce<gradsync::float16>(n, gradsync::DType::float16, 70'001);
            check_local_allreduce<gradsync::bfloat16>(n, gradsync::DType::bfloat16, 1);
        }
        // Broadcast on the device and the host; a host allreduce.
        std::vector<std::vector<float>> got(3);
        std::vector<double> host_sums(3);
        gradsync::cuda_local_spawn(3, [&](gradsync::CudaLocalBackend& backend) {
            const auto r = std::size_t(backend.rank());
            DeviceArray<float> data(1000);
            data.upload(std::vector<float>(1000, float(r)));
            backend.broadcast(std::as_writable_bytes(std::span(data.data, data.size)), 1);
            got[r] = data.download();
            double mine = double(r + 1);
            backend.allreduce(gradsync::Buffer{&mine, 1, gradsync::DType::float64}, gradsync::ReduceOp::sum);
            host_sums[r] = mine;
            backend.barrier();
        });
        for (std::size_t r = 0; r < 3; ++r) {
            CHECK(got[r] == std::vector<float>(1000, 1.0f));
            CHECK(host_sums[r] == 6.0);
        }
    }

    TEST_CASE("CudaLocalBackend: reduce_scatter and all_gather, 2 to 4 ranks, bit for bit, device and host memory") {
        for (int n : {2, 3, 4}) {
            CAPTURE(n);
            check_local_sharded<float>(n, gradsync::DType::float32, 100'003, true);
            check_local_sharded<double>(n, gradsync::DType::float64, 4096, true);
            check_local_sharded<gradsync::float16>(n, gradsync::DType::float16, 7, true);
            check_local_sharded<gradsync::bfloat16>(n, gradsync::DType::bfloat16, 1, true);
            check_local_sharded<float>(n, gradsync::DType::float32, 1001, false);
        }
    }

    TEST_CASE(
        "NcclBackend, a world of one: reduce_scatter and all_gather keep the values, and host memory is refused") {
        gradsync::NcclBackend<> backend(0, 1, 0, nccl_id());
        static_assert(gradsync::ShardedCollectives<gradsync::NcclBackend<>>);
        DeviceArray<float> data(1001);
        std::vector<float> values(1001);
        for (std::size_t i = 0; i < values.size(); ++i) values[i] = float(i) * 0.5f;
        data.upload(values);
        backend.reduce_scatter(gradsync::Buffer{data.data, data.size, gradsync::DType::float32},
                               gradsync::ReduceOp::average);
        backend.all_gather(gradsync::Buffer{data.data, data.size, gradsync::DType::float32});
        CHECK(data.download() == values);
        CHECK_THROWS_WITH_AS(
            backend.reduce_scatter(gradsync::Buffer{values.data(), values.size(), gradsync::DType::float32}),
            doctest::Contains("reduce_scatter takes device (or managed) memory"), gradsync::CollectiveError);
    }

    TEST_CASE("CudaLocalBackend: ranks that call different collectives fail alike, naming both calls") {
        std::vector<std::string> errors(2);
        CHECK_THROWS_AS(gradsync::cuda_local_spawn(2,
                                                   [&](gradsync::CudaLocalBackend& backend) {
                                                       DeviceArray<float> data(100);
                                                       const std::size_t count = backend.rank() == 0 ? 100 : 50;
                                                       try {
                                                           backend.allreduce(gradsync::Buffer{data.data, count,
                                                                                              gradsync::DType::float32},
                                                                             gradsync::ReduceOp::sum);
                                                       } catch (const gradsync::CollectiveError& e) {
                                                           errors[std::size_t(backend.rank())] = e.what();
                                                           throw;
                                                       }
                                                   }),
                        gradsync::CollectiveError);
        CHECK(errors[0] == errors[1]);
        CHECK(errors[0].find("called different collectives: rank 0 allreduce #1 of 100 x float32 (400 B), sum; rank 1 "
                             "allreduce #1 of 50 x float32 (200 B), sum") != std::string::npos);
    }

    TEST_CASE(
        "DataParallel<CudaLocalBackend, CudaMemory>: N ranks on one GPU end with the gradients of one process "
        "with the whole batch, bit for bit alike on every rank, and a gradient written late on a rank's stream "
        "is still the one reduced") {
        for (int n : {2, 3, 4}) {
            CAPTURE(n);
            check_mean_over_ranks(n, [](int ranks, auto fn) {
                gradsync::cuda_local_spawn(ranks, [&](gradsync::CudaLocalBackend& backend) { fn(backend); });
            });
        }
    }

    TEST_CASE(
        "DataParallel<NcclBackend, CudaMemory>, one rank per GPU (nccl_spawn): the mean of the ranks' gradients, "
        "bit for bit alike on every rank") {
        const int n = gradsync::cuda_devices().count;
        check_mean_over_ranks(n, [](int ranks, auto fn) {
            gradsync::nccl_spawn(ranks, [&](gradsync::NcclBackend<>& backend) { fn(backend); });
        });
    }

    TEST_CASE(
        "DataParallel<CudaLocalBackend, CudaMemory>, float16 and bfloat16 on the wire: the mean within the "
        "wire's precision, and a float16 sum that overflows is reduced again in float32") {
        const auto run = [](auto compression, float value) {
            std::vector<std::vector<float>> grads(2);
            gradsync::cuda_local_spawn(2, [&](gradsync::CudaLocalBackend& backend) {
                const auto r = std::size_t(backend.rank());
                const Stream stream;
                backend.set_compute_stream(stream);
                ScatteredDeviceModel model;
                gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream}, compression);
                model.fill(1.0f);
                // p0 holds `value` on every rank; the rest of the model keeps fill()'s pattern.
                std::vector<float> p0(model.sizes[0], value);
                GRADSYNC_CUDA_CHECK(
                    cudaMemcpy(model.grads[0], p0.data(), p0.size() * sizeof(float), cudaMemcpyHostToDevice));
                GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the step
                dp.synchronize();
                GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
                grads[r] = model.grad(0);
                auto p2 = model.grad(2);
                for (std::size_t k = 0; k < p2.size(); ++k)
                    if (p2[k] != doctest::Approx(float(k % 17) - 8.0f).epsilon(1e-2)) {
                        FAIL_CHECK("p2 element ", k, ": ", p2[k]);
                        break;
                    }
            });
            CHECK(same_bytes(grads[0], grads[1]));
            return grads[0];
        };
        // Each rank sends value / 2; the float16 sum of 1e5 overflows (the largest float16 is
        // 65504), so the bucket is reduced again in float32: exactly 1e5.
        CHECK(run(gradsync::Fp16Compression{}, 1e5f) == std::vector<float>(1000, 1e5f));
        CHECK(run(gradsync::Fp16Compression{}, 3.0f) == std::vector<float>(1000, 3.0f));
        CHECK(run(gradsync::Bf16Compression{}, 1e5f).front() == doctest::Approx(1e5f).epsilon(1e-2));
    }

    TEST_CASE(
        "step_on_device: the optimizer's kernel reads the verdict on the device, and the host waits for nothing") {
        const ncclUniqueId id = nccl_id();
        const Stream stream;
        {
            gradsync::NcclBackend<> backend(0, 1, 0, id, gradsync::NcclOptions{.compute_stream = stream});
            ScatteredDeviceModel model;
            gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                                      gradsync::StaticLossScale{.value = 2.0f},
                                      gradsync::Options{.check_histories = false});
            DeviceArray<int> applied(1);
            GRADSYNC_CUDA_CHECK(cudaMemset(applied.data, 0, sizeof(int)));
            model.fill(2.0f);
            GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
            late_fill<<<64, 256, 0, stream>>>(model.grads[2], model.sizes[2], 4.0f, 200'000'000LL);  // ~0.1 s
            const std::uint64_t waits = gradsync_standin_host_waits ? gradsync_standin_host_waits() : 0;
            dp.step_on_device([&](const gradsync::StepVerdict* verdict) {
                count_if_finite<<<1, 1, 0, stream>>>(verdict, applied.data);
            });
            CHECK(cudaStreamQuery(stream) == cudaErrorNotReady);  // the step is queued, not waited for
            if (gradsync_standin_host_waits) CHECK(gradsync_standin_host_waits() == waits);  // not one host wait
            GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
            CHECK(model.grad(2).front() == 2.0f);  // the late value, unscaled once
            // A second step on fresh gradients, one of them infinite: not applied, and p2 holds its
            // own value unscaled (the pass scales in place, so the same data again would halve it).
            model.fill(2.0f);
            const float inf = INFINITY;
            GRADSYNC_CUDA_CHECK(cudaMemcpy(model.grads[1], &inf, sizeof inf, cudaMemcpyHostToDevice));
            GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());  // landed before the step
            dp.step_on_device([&](const gradsync::StepVerdict* verdict) {
                count_if_finite<<<1, 1, 0, stream>>>(verdict, applied.data);
            });
            GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
            CHECK(applied.download() == std::vector<int>{1});  // the second step was not finite
            CHECK(model.grad(2).front() == -8.0f);             // fill(2): (0 - 8) * 2, unscaled by 2
        }
    }

    TEST_CASE("CudaMemory: a bucket table is made and replaced in the stream's order, with no host wait") {
        const Stream stream;
        ScatteredDeviceModel model;
        const auto host = model.fill(1.0f);
        std::vector<gradsync::Segment> segments;
        std::size_t total = 0;
        for (std::size_t i = 0; i < model.sizes.size(); ++i) {
            segments.push_back({model.grads[i], model.sizes[i]});
            total += model.sizes[i];
        }
        DeviceArray<float> bucket(total);
        gradsync::CudaMemory memory{stream};
        const std::uint64_t waits = gradsync_standin_host_waits ? gradsync_standin_host_waits() : 0;
        auto table = memory.table(segments, gradsync::DType::float32);
        table = memory.table(segments, gradsync::DType::float32);  // as gradients that moved during backward
        memory.pack(table, reinterpret_cast<std::byte*>(bucket.data));
        if (gradsync_standin_host_waits) CHECK(gradsync_standin_host_waits() == waits);
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<float> expected;
        for (const auto& h : host) expected.insert(expected.end(), h.begin(), h.end());
        CHECK(same_bytes(bucket.download(), expected));
    }

    TEST_CASE("CudaMemory: to_host and from_host (a checkpoint's copies) follow the work queued on the stream") {
        const Stream stream;
        constexpr std::size_t n = 1000;
        DeviceArray<float> tensor(n);
        gradsync::CudaMemory memory{stream};
        memory.prepare_results(0);  // scale() writes its sum to the slot after the last
        std::vector<float> values(n);
        for (std::size_t i = 0; i < n; ++i) values[i] = 0.5f * static_cast<float>(i) - 7.0f;
        memory.from_host(reinterpret_cast<std::byte*>(tensor.data), std::as_bytes(std::span(values)));
        const gradsync::Segment whole{tensor.data, n};
        memory.scale(memory.table(std::span(&whole, 1), gradsync::DType::float32), 2.0);  // queued, not waited for
        std::vector<float> back(n);
        memory.to_host(std::as_writable_bytes(std::span(back)), reinterpret_cast<const std::byte*>(tensor.data));
        for (auto& v : values) v *= 2.0f;
        CHECK(same_bytes(back, values));
    }

    TEST_CASE("DataParallel<NcclBackend, CudaMemory> on GPU 1 steps from a thread whose current device is GPU 0") {
        if (gradsync::cuda_devices().count < 2) {
            MESSAGE("skipped: needs two GPUs");
            return;
        }
        GRADSYNC_CUDA_CHECK(cudaSetDevice(1));
        {
            const Stream stream;
            gradsync::NcclBackend<> backend(0, 1, 1, nccl_id(), gradsync::NcclOptions{.compute_stream = stream});
            ScatteredDeviceModel model;
            gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                                      gradsync::StaticLossScale{.value = 2.0f});
            model.fill(2.0f);
            GRADSYNC_CUDA_CHECK(cudaSetDevice(0));  // every pass selects GPU 1 itself
            CHECK(dp.step([] {}).applied);
            GRADSYNC_CUDA_CHECK(cudaSetDevice(1));
            CHECK(model.grad(2).front() == -8.0f);  // fill(2): (0 - 8) * 2, unscaled by 2
        }
        GRADSYNC_CUDA_CHECK(cudaSetDevice(0));
    }

    TEST_CASE("NcclBackend<Ring> and <Tree> join and reduce (NCCL_ALGO set for their initialization)") {
        gradsync::NcclBackend<gradsync::nccl::Ring> ring(0, 1, 0, nccl_id());
        gradsync::NcclBackend<gradsync::nccl::Tree> tree(0, 1, 0, nccl_id());
        float one = 1;
        ring.allreduce(gradsync::Buffer{&one, 1, gradsync::DType::float32}, gradsync::ReduceOp::sum);
        tree.allreduce(gradsync::Buffer{&one, 1, gradsync::DType::float32}, gradsync::ReduceOp::sum);
        CHECK(one == 1.0f);
    }

    TEST_CASE("nccl_spawn: one thread per GPU, each rank's values summed and averaged") {
        const int n = gradsync::cuda_devices().count;
        std::vector<float> sums(static_cast<std::size_t>(n)), averages(static_cast<std::size_t>(n));
        gradsync::nccl_spawn(n, [&](gradsync::NcclBackend<>& backend) {
            DeviceArray<float> data(4096);
            const auto r = static_cast<std::size_t>(backend.rank());
            data.upload(std::vector<float>(data.size, float(r + 1)));
            backend.allreduce(gradsync::Buffer{data.data, data.size, gradsync::DType::float32},
                              gradsync::ReduceOp::sum);
            sums[r] = data.download().back();
            data.upload(std::vector<float>(data.size, float(r + 1)));
            backend.allreduce(gradsync::Buffer{data.data, data.size, gradsync::DType::float32},
                              gradsync::ReduceOp::average);
            averages[r] = data.download().front();
        });
        for (int r = 0; r < n; ++r) {
            CHECK(sums[std::size_t(r)] == float(n * (n + 1) / 2));
            CHECK(averages[std::size_t(r)] == doctest::Approx(float(n + 1) / 2.0f));
        }
    }

    TEST_CASE("nccl_spawn: a rank that throws aborts the others and its exception is rethrown") {
        const int n = gradsync::cuda_devices().count;
        CHECK_THROWS_WITH_AS(gradsync::nccl_spawn(n,
                                                  [](gradsync::NcclBackend<>& backend) {
                                                      if (backend.rank() == 0) throw gradsync::Error("rank 0 fails");
                                                      backend.barrier();  // waits for rank 0: ended by the abort
                                                  }),
                             "rank 0 fails", gradsync::Error);
    }

    TEST_CASE("NcclBackend: a rank that never joins ends the join at the deadline, naming it") {
        const ncclUniqueId id = nccl_id();
        const auto began = std::chrono::steady_clock::now();
        std::string what;
        try {
            gradsync::NcclBackend<> alone(0, 2, 0, id, gradsync::NcclOptions{.timeout = std::chrono::seconds(2)});
        } catch (const gradsync::TimeoutError& e) {
            what = e.what();
        }
        CHECK(what.find("gradsync: rank 0 of 2 (NCCL, GPU 0): the ranks did not all join the NCCL communicator "
                        "within 2000 ms") == 0);
        CHECK(std::chrono::steady_clock::now() - began < std::chrono::seconds(30));
    }

    TEST_CASE("NcclBackend: two ranks on one GPU are refused with NCCL's words, not a hang") {
        const ncclUniqueId id = nccl_id();
        std::string errors[2];
        std::vector<std::thread> threads;
        for (int r = 0; r < 2; ++r) {
            threads.emplace_back([&, r] {
                try {
                    gradsync::NcclBackend<> backend(r, 2, 0, id,
                                                    gradsync::NcclOptions{.timeout = std::chrono::seconds(30)});
                } catch (const gradsync::Error& e) {
                    errors[r] = e.what();
                }
            });
        }
        for (auto& t : threads) t.join();
        CAPTURE(errors[0]);
        CAPTURE(errors[1]);
        CHECK((errors[0].find("the same GPU") != std::string::npos ||
               errors[1].find("the same GPU") != std::string::npos));
    }

    TEST_CASE(
        "DataParallel<NcclBackend>, a world of one: contiguous device gradients synchronize, and step() is "
        "refused until the finalize pass runs on the device") {
        const ncclUniqueId id = nccl_id();
        gradsync::NcclBackend<> backend(0, 1, 0, id);
        const std::vector<std::size_t> sizes = {300, 7, 4096};
        DeviceArray<float> weights(4403), grads(4403);
        std::vector<float> g(4403);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = float(i) * 0.5f;
        grads.upload(g);
        gradsync::ContiguousParameters<float> model(weights.data, grads.data, sizes);
        gradsync::DataParallel dp(model, backend);
        for (std::size_t i = 0; i < sizes.size(); ++i) dp.grad_ready(i);
        dp.synchronize();
        CHECK(same_bytes(grads.download(), g));
        CHECK_THROWS_WITH_AS(dp.step([] {}),
                             doctest::Contains("need the finalize pass over the gradients, which device gradients "
                                               "get from a device memory policy"),
                             gradsync::Error);
    }
}

int main(int argc, char** argv) {
    // Lazily loaded kernels synchronize when first launched; tests check that a stream is still
    // busy after queueing a step, so every kernel is loaded up front (unless the caller chose).
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    doctest::Context context(argc, argv);
    context.setOption("no-colors", true);
    // The GPU suite without a GPU: skipped, with the reason, before any test runs.
    bool gpu_suite = false;
    for (int i = 1; i < argc; ++i) gpu_suite = gpu_suite || std::strcmp(argv[i], "--test-suite=gpu") == 0;
    if (gpu_suite) {
        const auto devices = gradsync::cuda_devices();
        if (devices.count == 0) {
            std::printf("skipped: %s\n", devices.why.c_str());
            return 0;
        }
        GRADSYNC_CUDA_CHECK(cudaSetDevice(0));  // the tests' own thread drives GPU 0, and says so
    }
    return context.run();
}
