// GPU benchmarks, each beside the device-to-device copy bandwidth measured in the same run
// (bytes read + written): the fused finalize of a 256 MiB bucket (the contiguous kernel, and the
// table kernel DataParallel runs, in place and from a packed bucket), pack and unpack of one
// 256 MiB tensor, and packing the ResNet-50 layout (161 tensors) in one launch; NcclBackend's host
// cost per collective beside raw NCCL calls on the same GPU (a world of one); DataParallel's own
// host cost per step, apart from the backend's; and DataParallel::synchronize() on the ResNet-50
// layout beside one raw allreduce of a flat buffer of the same bytes, over NcclBackend with every
// visible GPU (two or more) and over CudaLocalBackend with 2 ranks on one GPU. Without a CUDA
// device it says so and exits 0. Built and run by bench/gpu-check.sh.
#include <gradsync/backend/nccl.hpp>
#include <gradsync/launch/nccl_spawn.hpp>
#include <gradsync/model/contiguous_parameters.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/backend/cuda_local.cuh>
#include <gradsync/memory/cuda.cuh>
#include <gradsync/data_parallel.hpp>
#include <gradsync/memory/cuda/finalize.cuh>
#include <gradsync/memory/cuda/pack.cuh>

#include "model_layouts.hpp"

#include <algorithm>
#include <chrono>
#include <utility>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <vector>

// Outside the unnamed namespace: nvcc would call its traits, read only by concepts, unused.
namespace timing {

// A backend that forwards to another and adds up the host time spent inside its calls, so that
// what DataParallel itself costs the host per step can be told apart from the backend's share.
template <class B>
class TimedBackend {
public:
    static constexpr bool device_memory = true;
    static constexpr bool checks_tags = gradsync::CheckedCollectives<B>;
    using Handle = decltype(std::declval<B&>().allreduce_async(gradsync::Buffer{}, gradsync::ReduceOp::sum,
                                                               gradsync::CollectiveTag{}));

    explicit TimedBackend(B& inner) : inner_(inner) {}
    [[nodiscard]] int rank() const { return inner_.rank(); }
    [[nodiscard]] int size() const { return inner_.size(); }
    [[nodiscard]] bool supports(gradsync::DType t) const { return inner_.supports(t); }
    [[nodiscard]] cudaStream_t compute_stream() const { return inner_.compute_stream(); }
    Handle allreduce_async(gradsync::Buffer buf, gradsync::ReduceOp op, gradsync::CollectiveTag tag = {}) {
        return timed([&] { return inner_.allreduce_async(buf, op, tag); });
    }
    void allreduce(gradsync::Buffer buf, gradsync::ReduceOp op, gradsync::CollectiveTag tag = {}) {
        timed([&] { inner_.allreduce(buf, op, tag); });
    }
    void broadcast(std::span<std::byte> bytes, int root, gradsync::CollectiveTag tag = {}) {
        timed([&] { inner_.broadcast(bytes, root, tag); });
    }
    void barrier() {
        timed([&] { inner_.barrier(); });
    }
    void abort(const std::string& reason) { inner_.abort(reason); }
    void throw_if_failed() const { inner_.throw_if_failed(); }
    void wait_on_device(const Handle& h) {
        timed([&] { inner_.wait_on_device(h); });
    }

    double seconds = 0;  // inside the inner backend's calls

private:
    template <class F>
    decltype(auto) timed(F&& f) {
        const auto t0 = std::chrono::steady_clock::now();
        struct Add {
            double& to;
            std::chrono::steady_clock::time_point t0;
            ~Add() { to += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
        } add{seconds, t0};
        return f();
    }
    B& inner_;
};

}  // namespace timing

namespace {

// Median over `repeats` of the time of `work` on the default stream, in seconds.
double median_seconds(const std::function<void()>& work, int repeats = 21) {
    cudaEvent_t start, stop;
    GRADSYNC_CUDA_CHECK(cudaEventCreate(&start));
    GRADSYNC_CUDA_CHECK(cudaEventCreate(&stop));
    work();  // warm-up
    std::vector<double> times;
    for (int i = 0; i < repeats; ++i) {
        GRADSYNC_CUDA_CHECK(cudaEventRecord(start));
        work();
        GRADSYNC_CUDA_CHECK(cudaEventRecord(stop));
        GRADSYNC_CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0;
        GRADSYNC_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms * 1e-3);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    std::nth_element(times.begin(), times.begin() + repeats / 2, times.end());
    return times[std::size_t(repeats / 2)];
}

struct Pack {
    float* tensors = nullptr;
    float* bucket = nullptr;
    gradsync::cuda::Segment* table = nullptr;
    std::size_t segments = 0;
    std::size_t total = 0;
    explicit Pack(const std::vector<std::size_t>& sizes) {
        for (auto n : sizes) total += n;
        GRADSYNC_CUDA_CHECK(cudaMalloc(&tensors, total * sizeof(float)));
        GRADSYNC_CUDA_CHECK(cudaMalloc(&bucket, total * sizeof(float)));
        GRADSYNC_CUDA_CHECK(cudaMemset(tensors, 0, total * sizeof(float)));
        std::vector<gradsync::cuda::Segment> host;
        std::size_t at = 0;
        for (auto n : sizes) {
            host.push_back({tensors + at, n, at});
            at += n;
        }
        segments = host.size();
        GRADSYNC_CUDA_CHECK(cudaMalloc(&table, segments * sizeof(gradsync::cuda::Segment)));
        GRADSYNC_CUDA_CHECK(
            cudaMemcpy(table, host.data(), segments * sizeof(gradsync::cuda::Segment), cudaMemcpyHostToDevice));
    }
    ~Pack() {
        cudaFree(tensors);
        cudaFree(bucket);
        cudaFree(table);
    }
    double bytes_moved() const { return 2.0 * double(total) * sizeof(float); }
};

void report(const char* name, double seconds, double bytes, double copy_gbs, double target) {
    const double gbs = bytes / seconds * 1e-9;
    std::printf("  %-34s %9.3f ms  %8.1f GB/s  ratio to copy %.3f  (target >= %.2f: %s)\n", name, seconds * 1e3, gbs,
                gbs / copy_gbs, target, gbs / copy_gbs >= target ? "met" : "MISSED");
}

// Host time to queue `buckets` allreduces of 1 MiB, per bucket: raw ncclAllReduce + cudaEventRecord
// on a communicator of its own, against NcclBackend::allreduce_async (handle, watchdog and all),
// both in a world of one on this GPU. Medians of 21 rounds. A world of one takes NCCL's short
// path; with more ranks NCCL queues each collective from a thread of its own, which this does
// not measure.
void bench_nccl_host_cost() {
    constexpr int buckets = 200;
    constexpr std::size_t count = std::size_t(1) << 18;  // 1 MiB of float
    float* data = nullptr;
    GRADSYNC_CUDA_CHECK(cudaMalloc(&data, buckets * count * sizeof(float)));
    GRADSYNC_CUDA_CHECK(cudaMemset(data, 0, buckets * count * sizeof(float)));
    ncclUniqueId id{}, raw_id{};
    if (ncclGetUniqueId(&id) != ncclSuccess || ncclGetUniqueId(&raw_id) != ncclSuccess)
        throw gradsync::Error("ncclGetUniqueId failed");
    gradsync::NcclBackend<> backend(0, 1, 0, id);
    ncclComm_t raw = nullptr;
    if (ncclCommInitRank(&raw, 1, raw_id, 0) != ncclSuccess) throw gradsync::Error("ncclCommInitRank failed");
    cudaStream_t stream = nullptr;
    GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<cudaEvent_t> events(buckets);
    for (auto& e : events) GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

    const auto per_bucket_us = [&](const std::function<void()>& queue, const std::function<void()>& finish) {
        std::vector<double> times;
        for (int round = 0; round < 22; ++round) {
            const auto t0 = std::chrono::steady_clock::now();
            queue();
            const auto t1 = std::chrono::steady_clock::now();
            finish();
            if (round > 0) times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / buckets);
        }
        std::nth_element(times.begin(), times.begin() + 10, times.end());
        return times[10];
    };
    const double raw_us = per_bucket_us(
        [&] {
            for (int b = 0; b < buckets; ++b) {
                if (ncclAllReduce(data + b * count, data + b * count, count, ncclFloat32, ncclAvg, raw, stream) !=
                    ncclSuccess)
                    throw gradsync::Error("ncclAllReduce failed");
                GRADSYNC_CUDA_CHECK(cudaEventRecord(events[std::size_t(b)], stream));
            }
        },
        [&] { GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream)); });
    std::vector<gradsync::NcclHandle> handles;
    handles.reserve(buckets);
    const double ours_us = per_bucket_us(
        [&] {
            for (int b = 0; b < buckets; ++b)
                handles.push_back(backend.allreduce_async(
                    gradsync::Buffer{data + b * count, count, gradsync::DType::float32}, gradsync::ReduceOp::average));
        },
        [&] {
            for (auto& h : handles) h.wait();
            handles.clear();
        });
    std::printf(
        "  %-34s %9.2f us per bucket; raw ncclAllReduce + event %.2f us: added %.2f us  (target <= 10: %s)\n"
        "  %-34s (a world of one: NCCL's multi-rank launch path is not in this figure)\n",
        "NcclBackend host cost, 1 MiB", ours_us, raw_us, ours_us - raw_us, ours_us - raw_us <= 10.0 ? "met" : "MISSED",
        "");
    for (auto e : events) cudaEventDestroy(e);
    cudaStreamDestroy(stream);
    ncclCommDestroy(raw);
    cudaFree(data);
}

// The ResNet-50 layout's gradients on this rank's GPU, as one buffer (every bucket a view) or
// one allocation per tensor (every bucket packed).
struct DeviceLayout {
    std::vector<std::size_t> sizes;
    std::size_t total = 0;
    bool scattered = false;
    std::vector<float*> blocks;  // one, or one per tensor
    std::vector<gradsync::Parameter> params;
    DeviceLayout(bool scattered_, const std::vector<std::size_t>& sizes_) : sizes(sizes_), scattered(scattered_) {
        for (auto n : sizes) total += n;
        if (!scattered) blocks.push_back(nullptr);
        for (std::size_t i = 0; i < (scattered ? sizes.size() : 1); ++i) {
            const std::size_t n = scattered ? sizes[i] : total;
            float* p = nullptr;
            GRADSYNC_CUDA_CHECK(cudaMalloc(&p, 2 * n * sizeof(float)));  // weights, then gradients
            GRADSYNC_CUDA_CHECK(cudaMemset(p, 0, 2 * n * sizeof(float)));
            if (scattered)
                blocks.push_back(p);
            else
                blocks[0] = p;
        }
        std::size_t at = 0;
        for (std::size_t i = 0; i < sizes.size(); ++i) {
            float* w = scattered ? blocks[i] : blocks[0] + at;
            float* g = scattered ? blocks[i] + sizes[i] : blocks[0] + total + at;
            params.push_back({"t" + std::to_string(i), w, g, sizes[i], gradsync::DType::float32});
            at += sizes[i];
        }
    }
    DeviceLayout(const DeviceLayout&) = delete;
    DeviceLayout& operator=(const DeviceLayout&) = delete;
    ~DeviceLayout() {
        for (auto* p : blocks) cudaFree(p);
    }
    std::vector<gradsync::Parameter> parameters() const { return params; }
};

// The host time of one step (grad_ready for every tensor, then synchronize(), without waiting
// for the device) on the ResNet-50 layout, packed, over 2 CudaLocalBackend ranks on one GPU, and
// the part of it spent outside the backend: DataParallel's own work (readiness, launching,
// queueing the pack and finalize kernels). Rank 0's medians over 21 steps.
void bench_step_host_cost() {
    std::vector<std::size_t> sizes;
    for (const auto& t : layouts::resnet50()) sizes.push_back(t.count);
    double total_us = 0, own_us = 0;
    std::size_t buckets = 0;
    gradsync::cuda_local_spawn(2, [&](gradsync::CudaLocalBackend& local) {
        cudaStream_t stream = nullptr;
        GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        local.set_compute_stream(stream);
        timing::TimedBackend<gradsync::CudaLocalBackend> backend(local);
        {
            DeviceLayout model(true, sizes);
            gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                                      gradsync::StaticLossScale{.value = 1024.0f});
            std::vector<double> totals, owns;
            for (int round = 0; round < 22; ++round) {
                local.barrier();
                GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
                backend.seconds = 0;
                const auto t0 = std::chrono::steady_clock::now();
                for (std::size_t i = sizes.size(); i-- > 0;) dp.grad_ready(i);
                dp.synchronize();
                const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                const double inside = backend.seconds;
                GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
                if (round == 0) continue;
                totals.push_back(total * 1e6);
                owns.push_back((total - inside) * 1e6);
            }
            if (local.rank() == 0) {
                std::nth_element(totals.begin(), totals.begin() + 10, totals.end());
                std::nth_element(owns.begin(), owns.begin() + 10, owns.end());
                total_us = totals[10];
                own_us = owns[10];
                buckets = dp.plan().buckets.size();
            }
        }
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
        cudaStreamDestroy(stream);
    });
    std::printf(
        "  %-34s %9.1f us per step, %.1f us per bucket (%zu buckets); the step's host time %.1f us, the rest "
        "inside the backend (2 CudaLocalBackend ranks meeting on the host)\n",
        "DataParallel host cost, ResNet-50", own_us, own_us / double(buckets), buckets, total_us);
}

// Median over `rounds` of DataParallel::synchronize() and of one raw allreduce of a flat buffer
// of the same bytes, interleaved, each timed on the host to the end of the compute stream.
template <class Backend, class RawAllreduce>
std::pair<double, double> time_synchronize(Backend& backend, cudaStream_t stream, bool scattered,
                                           const RawAllreduce& raw) {
    std::vector<std::size_t> sizes;
    for (const auto& t : layouts::resnet50()) sizes.push_back(t.count);
    DeviceLayout model(scattered, sizes);
    gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream},
                              gradsync::Options{.check_histories = false});
    float* flat = nullptr;
    GRADSYNC_CUDA_CHECK(cudaMalloc(&flat, model.total * sizeof(float)));
    GRADSYNC_CUDA_CHECK(cudaMemset(flat, 0, model.total * sizeof(float)));
    std::vector<double> ours, theirs;
    for (int round = 0; round < 22; ++round) {
        backend.barrier();
        auto t0 = std::chrono::steady_clock::now();
        for (std::size_t i = sizes.size(); i-- > 0;) dp.grad_ready(i);
        dp.synchronize();
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
        auto t1 = std::chrono::steady_clock::now();
        backend.barrier();
        auto t2 = std::chrono::steady_clock::now();
        raw(flat, model.total);
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
        auto t3 = std::chrono::steady_clock::now();
        if (round == 0) continue;  // warm-up
        ours.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        theirs.push_back(std::chrono::duration<double, std::milli>(t3 - t2).count());
    }
    cudaFree(flat);
    std::nth_element(ours.begin(), ours.begin() + 10, ours.end());
    std::nth_element(theirs.begin(), theirs.begin() + 10, theirs.end());
    return {ours[10], theirs[10]};
}

void report_synchronize(const char* what, bool scattered, std::pair<double, double> t) {
    std::printf("  %-44s %s %8.3f ms  raw flat allreduce %8.3f ms  ratio %.3f  (target <= 1.05: %s)\n", what,
                scattered ? "packed" : "view  ", t.first, t.second, t.first / t.second,
                t.first / t.second <= 1.05 ? "met" : "MISSED");
}

// One rank's share of the synchronize benchmark: its own compute stream, the raw allreduce
// through the same backend; rank 0's figures go to `out`.
template <class Backend>
void time_rank(Backend& backend, bool scattered, std::pair<double, double>& out) {
    cudaStream_t stream = nullptr;
    GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    backend.set_compute_stream(stream);
    const auto r = time_synchronize(backend, stream, scattered, [&](float* flat, std::size_t n) {
        backend.wait_on_device(
            backend.allreduce_async(gradsync::Buffer{flat, n, gradsync::DType::float32}, gradsync::ReduceOp::average));
    });
    if (backend.rank() == 0) out = r;
    GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaStreamDestroy(stream);
}

// DataParallel over NcclBackend, one thread per visible GPU; needs two or more.
void bench_nccl_synchronize(int gpus) {
    if (gpus < 2) {
        std::printf("  DataParallel<NcclBackend> synchronize, ResNet-50: skipped, needs 2 GPUs (%d visible)\n", gpus);
        return;
    }
    for (bool scattered : {false, true}) {
        std::pair<double, double> t;
        gradsync::nccl_spawn(gpus, [&](gradsync::NcclBackend<>& backend) { time_rank(backend, scattered, t); });
        char what[64];
        std::snprintf(what, sizeof what, "DataParallel<NcclBackend> ResNet-50, %d GPUs", gpus);
        report_synchronize(what, scattered, t);
    }
}

// DataParallel over CudaLocalBackend, 2 ranks on GPU 0: the device path's own overhead.
void bench_local_synchronize() {
    for (bool scattered : {false, true}) {
        std::pair<double, double> t;
        gradsync::cuda_local_spawn(2, [&](gradsync::CudaLocalBackend& backend) { time_rank(backend, scattered, t); });
        report_synchronize("DataParallel<CudaLocalBackend> ResNet-50, 2 ranks", scattered, t);
    }
}

}  // namespace

int main() {
    const auto devices = gradsync::cuda_devices();
    if (devices.count == 0) {
        std::printf("skipped: %s\n", devices.why.c_str());
        return 0;
    }
    cudaDeviceProp prop{};
    GRADSYNC_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("GPU benchmarks on %s, medians of 21\n", prop.name);

    const std::size_t big = std::size_t(256) << 20 >> 2;  // 256 MiB of float
    Pack one({big});
    const double copy_s = median_seconds([&] {
        GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(one.bucket, one.tensors, big * sizeof(float), cudaMemcpyDeviceToDevice));
    });
    const double copy_gbs = one.bytes_moved() / copy_s * 1e-9;
    std::printf("  %-34s %9.3f ms  %8.1f GB/s  (the ceiling: bytes read + written)\n", "cudaMemcpy device to device",
                copy_s * 1e3, copy_gbs);
    gradsync::cuda::FinalizeScratch scratch;
    report("finalize, 256 MiB float32 bucket",
           median_seconds([&] { gradsync::cuda::finalize<float>(one.bucket, one.total, 0.5, scratch, nullptr); }),
           one.bytes_moved(), copy_gbs, 0.9);
    {
        // The table kernel, as DataParallel runs it through CudaMemory: in place (a view bucket),
        // and from the reduced packed bucket into the tensor (unpack fused with the pass).
        gradsync::CudaMemory memory{nullptr};
        const gradsync::Segment segment{one.tensors, one.total};
        const auto table = memory.table(std::span(&segment, 1), gradsync::DType::float32);
        memory.prepare_results(1);
        report("finalize in place (DataParallel)",
               median_seconds([&] { memory.finalize(table, nullptr, gradsync::DType::float32, 0.5, 0); }),
               one.bytes_moved(), copy_gbs, 0.9);
        report("finalize from a packed bucket", median_seconds([&] {
                   memory.finalize(table, reinterpret_cast<const std::byte*>(one.bucket), gradsync::DType::float32, 0.5,
                                   0);
               }),
               one.bytes_moved(), copy_gbs, 0.9);
    }
    const std::span<const gradsync::cuda::Segment> one_table(one.table, one.segments);
    report("pack, one 256 MiB tensor",
           median_seconds([&] { gradsync::cuda::pack<float>(one_table, one.bucket, one.total, nullptr); }),
           one.bytes_moved(), copy_gbs, 0.85);
    report("unpack, one 256 MiB tensor",
           median_seconds([&] { gradsync::cuda::unpack<float>(one_table, one.bucket, one.total, nullptr); }),
           one.bytes_moved(), copy_gbs, 0.85);

    std::vector<std::size_t> resnet;
    for (const auto& t : layouts::resnet50()) resnet.push_back(t.count);
    Pack layout(resnet);
    const std::span<const gradsync::cuda::Segment> layout_table(layout.table, layout.segments);
    report("pack, ResNet-50 (161 tensors)",
           median_seconds([&] { gradsync::cuda::pack<float>(layout_table, layout.bucket, layout.total, nullptr); }),
           layout.bytes_moved(), copy_gbs, 0.7);
    bench_nccl_host_cost();
    bench_step_host_cost();
    bench_local_synchronize();
    bench_nccl_synchronize(devices.count);
    return 0;
}
