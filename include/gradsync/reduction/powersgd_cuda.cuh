// CudaPowerSGD: PowerSGD (reduction/powersgd.hpp) on device memory, for NcclBackend and
// CudaLocalBackend with CudaMemory. The same algorithm, configuration and agreed settings; every
// pass runs as kernels on the trainer's stream (reduction/cuda/powersgd_kernels.cuh), the state
// (each matrix's error and Q) lives on the device, and the stream, not the host, waits for the
// collectives, so a step with it has no host wait of its own. Where a sum is not finite, every
// rank learns it on the device: the matrices' gradients are left NaN and the state stays.
#pragma once

#include <gradsync/cuda/check.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/memory/cuda/device_bytes.cuh>
#include <gradsync/reduction/comm_hook.hpp>
#include <gradsync/reduction/cuda/powersgd_kernels.cuh>
#include <gradsync/reduction/powersgd_config.hpp>

#include <cuda_runtime.h>

#include <algorithm>  // for std::clamp, std::ranges::equal, std::min, std::max
#include <cstddef>
#include <cstdint>
#include <cstring>  // for std::memcpy
#include <map>
#include <memory>  // for std::unique_ptr
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0 {

class CudaPowerSGD {
public:
    using policy_category = policy_category::comm_hook;
    using Config = PowerSGDConfig;
    static constexpr bool hooked = true;
    static constexpr bool on_device = true;

    CudaPowerSGD() = default;
    explicit CudaPowerSGD(Config config) : config_(config) {}
    // A copy takes the configuration and starts without device state: one hook handed to the
    // DataParallel of every rank in a process (nccl_spawn) must not share its error and Q.
    CudaPowerSGD(const CudaPowerSGD& other) : config_(other.config_) {}
    CudaPowerSGD& operator=(const CudaPowerSGD& other) {
        if (this != &other) *this = CudaPowerSGD(other.config_);
        return *this;
    }
    CudaPowerSGD(CudaPowerSGD&&) noexcept = default;
    CudaPowerSGD& operator=(CudaPowerSGD&&) noexcept = default;
    ~CudaPowerSGD() = default;

    [[nodiscard]] std::string settings() const { return detail::powersgd_settings(config_); }
    [[nodiscard]] std::string invalid() const { return detail::powersgd_invalid(config_); }
    [[nodiscard]] const Config& config() const { return config_; }

    // Elements this rank handed to collectives since construction, and the elements of the
    // buckets it reduced (what plain allreduces would have moved).
    [[nodiscard]] std::uint64_t elements_sent() const { return sent_; }
    [[nodiscard]] std::uint64_t elements_reduced() const { return reduced_; }

    // The state of each compressed matrix, by parameter name, copied to the host (waits for the
    // stream the hook last ran on).
    [[nodiscard]] std::map<std::string, PowerSGDState> state_on_host() const {
        std::map<std::string, PowerSGDState> out;
        if (stream_ != nullptr) GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream_));
        for (const auto& [name, st] : device_->state) {
            auto& host = out[name];
            host.error = download(st.error);
            host.q = download(st.q);
        }
        return out;
    }

    // Where each matrix's state lies in device memory, by parameter name (Checkpoint::add(hook)
    // saves and loads it through the front's memory policy).
    [[nodiscard]] std::map<std::string, PowerSGDArrays> state_arrays() {
        std::map<std::string, PowerSGDArrays> out;
        for (auto& [name, st] : device_->state) out[name] = {floats(st.error), floats(st.q)};
        return out;
    }

    // Makes the state of every matrix among `parameters` on `stream`'s device (the engine calls it
    // when it plans the buckets), so that a checkpoint can restore it before the first step.
    void prepare(std::span<const HookParameter> parameters, void* stream) {
        stream_ = static_cast<cudaStream_t>(stream);
        gradsync::detail::DeviceScope scope(gradsync::detail::device_of(stream_));
        for (const auto& p : parameters)
            if (const auto shape = detail::powersgd_shape(config_, p)) make_state(p.name, *shape);
    }

    HookComm::Pending start(const HookBucket& bucket, HookComm& comm) {
        if (bucket.stream == nullptr)
            throw Error("gradsync: CudaPowerSGD computes on the device, and this bucket's gradients lie on the host");
        stream_ = static_cast<cudaStream_t>(bucket.stream);
        gradsync::detail::DeviceScope scope(gradsync::detail::device_of(stream_));
        auto& w = work_for(bucket);
        float* values = bucket.values.data();
        if (!config_.warm_start)
            for (const auto& d : w.draws) draw(d.q, d.count, d.key ^ detail::powersgd_step_key(config_, bucket.step));
        if (!w.matrices.empty()) {
            GRADSYNC_CUDA_CHECK(cudaMemsetAsync(w.nonfinite.data(), 0, sizeof(unsigned), stream_));
            for_matrices(w, w.max_rows, [&](dim3 grid, const cuda::LowRankMatrix* table) {
                cuda::detail::lowrank_begin_kernel<>
                    <<<grid, cuda::detail::lowrank_threads, 0, stream_>>>(table, values, ps(w), bucket.loss_scale);
            });
        }
        if (!w.exact.empty()) copy_exact<true>(w, values);
        reduced_ += bucket.values.size();
        sent_ += w.ps_count + w.flat_count;
        HookComm::Pending pending;
        if (w.ps_count != 0) pending = comm.allreduce_async({ps(w), w.ps_count}, ReduceOp::sum);
        if (w.flat_count != 0) pending.join(comm.allreduce_async({flat(w), w.flat_count}, ReduceOp::average));
        return pending;
    }

    void finish(const HookBucket& bucket, HookComm& comm) {
        gradsync::detail::DeviceScope scope(gradsync::detail::device_of(stream_));
        auto& w = device_->work.at(bucket.index);
        float* values = bucket.values.data();
        if (!w.exact.empty()) copy_exact<false>(w, values);
        if (w.matrices.empty()) return;
        auto* nonfinite = reinterpret_cast<unsigned*>(w.nonfinite.data());
        cuda::detail::lowrank_orthonormalize_kernel<>
            <<<unsigned(w.matrices.size()), cuda::detail::lowrank_threads, 0, stream_>>>(table(w), ps(w), nonfinite);
        GRADSYNC_CUDA_CHECK(cudaGetLastError());
        in_launches(w.matrices.size(), [&](std::size_t first, unsigned count) {  // blockIdx.z the matrix
            const dim3 grid(blocks_for(w.max_columns), static_cast<unsigned>(w.max_chunks), count);
            cuda::detail::lowrank_project_kernel<>
                <<<grid, cuda::detail::lowrank_threads, 0, stream_>>>(table(w) + first, values, ps(w), partials(w));
        });
        for_matrices(w, w.max_q, [&](dim3 grid, const cuda::LowRankMatrix* t) {
            cuda::detail::lowrank_sum_chunks_kernel<>
                <<<grid, cuda::detail::lowrank_threads, 0, stream_>>>(t, partials(w), qs(w));
        });
        // Issued whatever the P sums held, so that every rank issues the same collectives.
        sent_ += w.qs_count;
        comm.allreduce({qs(w), w.qs_count}, ReduceOp::sum);
        cuda::detail::lowrank_nonfinite_kernel<>
            <<<blocks_for(w.qs_count), cuda::detail::lowrank_threads, 0, stream_>>>(qs(w), w.qs_count, nonfinite);
        GRADSYNC_CUDA_CHECK(cudaGetLastError());
        const float share = 1.0f / static_cast<float>(comm.size());
        for_matrices(w, w.max_elements, [&](dim3 grid, const cuda::LowRankMatrix* t) {
            cuda::detail::lowrank_approximate_kernel<><<<grid, cuda::detail::lowrank_threads, 0, stream_>>>(
                t, values, ps(w), qs(w), share, 1.0f / bucket.loss_scale, config_.warm_start, nonfinite);
        });
    }

private:
    // A matrix's state on the device.
    struct DeviceState {
        cuda::DeviceBytes error, q;  // n x m (empty without error feedback) and r x m floats
    };
    // A newly made Q to draw (and, without warm start, every step's).
    struct Draw {
        float* q;
        std::uint64_t count, key;
    };
    // One bucket's arrays and tables, made at its first step and again when its parameters change.
    struct Work {
        std::vector<HookParameter> layout;  // the parameters the tables were made for
        std::vector<cuda::LowRankMatrix> matrices;
        std::vector<cuda::ExactRange> exact;
        std::vector<Draw> draws;
        std::uint64_t ps_count = 0, qs_count = 0, flat_count = 0, partials_count = 0;
        std::uint64_t max_rows = 0, max_columns = 0, max_chunks = 0, max_q = 0, max_elements = 0, max_exact = 0;
        cuda::DeviceBytes arrays;     // P^T, Q^T, the exact values and M^T P's partial sums, one after another
        cuda::DeviceBytes tables;     // the matrices, then the exact ranges
        cuda::DeviceBytes nonfinite;  // one unsigned: a sum was not finite
    };

    static float* ps(Work& w) { return reinterpret_cast<float*>(w.arrays.data()); }
    static float* qs(Work& w) { return ps(w) + w.ps_count; }
    static float* flat(Work& w) { return qs(w) + w.qs_count; }
    static float* partials(Work& w) { return flat(w) + w.flat_count; }
    static const cuda::LowRankMatrix* table(Work& w) {
        return reinterpret_cast<const cuda::LowRankMatrix*>(w.tables.data());
    }
    static const cuda::ExactRange* ranges(Work& w) {
        return reinterpret_cast<const cuda::ExactRange*>(w.tables.data() +
                                                         w.matrices.size() * sizeof(cuda::LowRankMatrix));
    }

    static unsigned blocks_for(std::uint64_t threads) {
        return static_cast<unsigned>(std::clamp<std::uint64_t>(
            (threads + cuda::detail::lowrank_threads - 1) / cuda::detail::lowrank_threads, 1, 1024));
    }

    // Calls launch(first, count) for the entries of a table of `total`, at most 65535 at a time
    // (the most a grid's y or z dimension holds), and checks each launch.
    template <class Launch>
    static void in_launches(std::size_t total, Launch&& launch) {
        for (std::size_t first = 0; first < total; first += 65535) {
            launch(first, static_cast<unsigned>(std::min<std::size_t>(65535, total - first)));
            GRADSYNC_CUDA_CHECK(cudaGetLastError());
        }
    }
    // Launches fn(grid, table) over the bucket's matrices, blockIdx.y the matrix.
    template <class Fn>
    void for_matrices(Work& w, std::uint64_t threads, Fn&& fn) {
        in_launches(w.matrices.size(),
                    [&](std::size_t first, unsigned count) { fn(dim3(blocks_for(threads), count), table(w) + first); });
    }

    template <bool to_array>
    void copy_exact(Work& w, float* values) {
        in_launches(w.exact.size(), [&](std::size_t first, unsigned count) {
            cuda::detail::lowrank_exact_kernel<to_array>
                <<<dim3(blocks_for(w.max_exact), count), cuda::detail::lowrank_threads, 0, stream_>>>(ranges(w) + first,
                                                                                                      values, flat(w));
        });
    }

    void draw(float* q, std::uint64_t count, std::uint64_t key) {
        if (count == 0) return;
        cuda::detail::lowrank_draw_kernel<>
            <<<blocks_for(count), cuda::detail::lowrank_threads, 0, stream_>>>(q, count, key);
        GRADSYNC_CUDA_CHECK(cudaGetLastError());
    }

    std::vector<float> download(const cuda::DeviceBytes& bytes) const {
        std::vector<float> host(bytes.size() / sizeof(float));
        if (!host.empty())
            GRADSYNC_CUDA_CHECK(cudaMemcpy(host.data(), bytes.data(), bytes.size(), cudaMemcpyDeviceToHost));
        return host;
    }

    static std::span<float> floats(const cuda::DeviceBytes& bytes) {
        return {reinterpret_cast<float*>(bytes.data()), bytes.size() / sizeof(float)};
    }

    // A matrix's state, made when missing or of another shape: the error zero, Q drawn from the seed.
    DeviceState& make_state(const std::string& name, const detail::LowRankShape& shape) {
        auto& st = device_->state[name];
        const std::uint64_t errors = config_.error_feedback ? shape.n * shape.m : 0;
        if (st.error.size() != errors * sizeof(float)) {
            st.error = cuda::DeviceBytes(errors * sizeof(float), stream_);
            if (errors != 0) GRADSYNC_CUDA_CHECK(cudaMemsetAsync(st.error.data(), 0, st.error.size(), stream_));
        }
        const std::uint64_t qn = shape.m * shape.r;
        if (st.q.size() != qn * sizeof(float)) {
            st.q = cuda::DeviceBytes(qn * sizeof(float), stream_);
            if (config_.warm_start)
                draw(reinterpret_cast<float*>(st.q.data()), qn, detail::powersgd_key(config_, name));
        }
        return st;
    }

    // The bucket's work, made again when its parameters differ from last time; a matrix's state is
    // kept where it has the same shape.
    Work& work_for(const HookBucket& bucket) {
        auto [at, fresh] = device_->work.try_emplace(bucket.index);
        auto& w = at->second;
        if (!fresh && std::ranges::equal(w.layout, bucket.parameters)) return w;
        w = Work{};
        w.layout.assign(bucket.parameters.begin(), bucket.parameters.end());
        for (const auto& p : bucket.parameters) {
            const auto shape = detail::powersgd_shape(config_, p);
            if (!shape) {
                w.exact.push_back({p.offset, w.flat_count, p.count});
                w.flat_count += p.count;
                w.max_exact = std::max<std::uint64_t>(w.max_exact, p.count);
                continue;
            }
            auto& st = make_state(p.name, *shape);
            auto* q = reinterpret_cast<float*>(st.q.data());
            w.draws.push_back({q, shape->m * shape->r, detail::powersgd_key(config_, p.name)});
            w.matrices.push_back({p.offset, shape->n, shape->m, shape->r, w.ps_count, w.qs_count, w.partials_count,
                                  st.error.size() != 0 ? reinterpret_cast<float*>(st.error.data()) : nullptr, q});
            w.ps_count += shape->n * shape->r;
            w.qs_count += shape->m * shape->r;
            const std::uint64_t chunks = cuda::detail::lowrank_chunks(shape->n);
            if (chunks > 65535)  // blockIdx.y of the M^T P pass
                throw Error("gradsync: CudaPowerSGD compresses matrices of at most " +
                            std::to_string(65535 * cuda::detail::lowrank_rows_per_chunk) + " rows; '" + p.name +
                            "' has " + std::to_string(shape->n));
            w.partials_count += chunks * shape->r * shape->m;
            w.max_chunks = std::max(w.max_chunks, chunks);
            w.max_q = std::max<std::uint64_t>(w.max_q, shape->m * shape->r);
            w.max_rows = std::max<std::uint64_t>(w.max_rows, shape->n * 32);
            w.max_columns = std::max<std::uint64_t>(w.max_columns, shape->m);
            w.max_elements = std::max<std::uint64_t>(w.max_elements, shape->n * shape->m);
        }
        w.arrays =
            cuda::DeviceBytes((w.ps_count + w.qs_count + w.flat_count + w.partials_count) * sizeof(float), stream_);
        std::vector<std::byte> tables(w.matrices.size() * sizeof(cuda::LowRankMatrix) +
                                      w.exact.size() * sizeof(cuda::ExactRange));
        if (!w.matrices.empty())
            std::memcpy(tables.data(), w.matrices.data(), w.matrices.size() * sizeof(cuda::LowRankMatrix));
        if (!w.exact.empty())
            std::memcpy(tables.data() + w.matrices.size() * sizeof(cuda::LowRankMatrix), w.exact.data(),
                        w.exact.size() * sizeof(cuda::ExactRange));
        w.tables = cuda::DeviceBytes(tables.size(), stream_);
        // From pageable memory: staged before the call returns.
        if (!tables.empty())
            GRADSYNC_CUDA_CHECK(
                cudaMemcpyAsync(w.tables.data(), tables.data(), tables.size(), cudaMemcpyHostToDevice, stream_));
        w.nonfinite = cuda::DeviceBytes(sizeof(unsigned), stream_);
        return w;
    }

    // What lives on the device (DataParallel holds its own copy of the hook, read through
    // dp.comm_hook()).
    struct Device {
        std::map<std::string, DeviceState> state;
        std::map<std::size_t, Work> work;  // by bucket
    };

    Config config_;
    std::unique_ptr<Device> device_ = std::make_unique<Device>();
    cudaStream_t stream_ = nullptr;
    std::uint64_t sent_ = 0, reduced_ = 0;
};

}  // namespace gradsync::inline v0
