// CudaLocalBackend: ranks are threads of one process that share one GPU, and collectives reduce
// the ranks' device buffers with one kernel. NCCL refuses two ranks on one GPU; this backend is
// how the device path of DataParallel (CudaMemory, streams, the kernels) runs with 2 to 8 ranks
// on a single GPU, so that "N ranks == one process with the whole batch" can be tested there.
// Like NcclBackend it orders each collective after the rank's compute stream and lets that
// stream wait for the result without the host; unlike it, the host meets its peers' threads at
// every collective (a Rendezvous), which checks that every rank issued the same one. Sums run
// in rank order in the accumulator type, as LocalBackend's do, so results are bitwise the same on
// every rank. Needs nvcc.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/cuda/convert.cuh>
#include <gradsync/detail/aligned_bytes.hpp>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/detail/first_error.hpp>
#include <gradsync/backend/detail/host_reduce.hpp>
#include <gradsync/backend/detail/rendezvous.hpp>
#include <gradsync/backend/detail/typed_calls.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

#include <cuda_runtime.h>

#include <chrono>
#include <cstring>  // for std::memcpy
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <type_traits>  // for std::is_invocable_v
#include <utility>      // for std::exchange, std::move
#include <vector>

namespace gradsync::inline v0 {

struct CudaLocalOptions {
    int device = 0;  // the GPU every rank uses
    // Every rendezvous and every collective ends by then; otherwise the group is aborted.
    std::chrono::milliseconds timeout = std::chrono::seconds(600);
};

namespace cuda::detail {

inline constexpr int max_local_ranks = 8;

struct RankPointers {
    void* at[max_local_ranks];
};

// For every element: the sum over the ranks' buffers in rank order, in the accumulator type,
// times `factor` when `scaled`, written back to every rank's buffer. The loops over the ranks
// are unrolled to the most there can be, so the pointer table stays in the kernel's parameters
// instead of being copied to local memory for indexing at run time.
template <class T>
__global__ void reduce_ranks_kernel(RankPointers ptrs, int ranks, std::uint64_t n, bool scaled,
                                    device_accumulator_t<T> factor) {
    using A = device_accumulator_t<T>;
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += std::uint64_t(gridDim.x) * blockDim.x) {
        A sum = widen(static_cast<const T*>(ptrs.at[0])[i]);
#pragma unroll
        for (int r = 1; r < max_local_ranks; ++r)
            if (r < ranks) sum += widen(static_cast<const T*>(ptrs.at[r])[i]);
        const T out = narrow<T>(scaled ? sum * factor : sum);
#pragma unroll
        for (int r = 0; r < max_local_ranks; ++r)
            if (r < ranks) static_cast<T*>(ptrs.at[r])[i] = out;
    }
}

// A CUDA event shared by the handles of one collective, destroyed with the last of them.
using SharedEvent = std::shared_ptr<CUevent_st>;

inline SharedEvent make_event() {
    cudaEvent_t e = nullptr;
    GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return SharedEvent(e, [](cudaEvent_t x) { cudaEventDestroy(x); });
}

// What each rank publishes at a rendezvous: the collective, its memory, and its events.
struct LocalDeviceCall : CollectiveCall {
    void* data = nullptr;
    bool on_device = false;
    cudaEvent_t ready = nullptr;  // recorded on the rank's compute stream when it called
    SharedEvent done;             // the second round: rank 0's, when the device work is queued

    [[nodiscard]] bool same_call(const LocalDeviceCall& o) const { return same_as(o) && on_device == o.on_device; }
    [[nodiscard]] std::string what() const { return describe() + (on_device ? "" : ", host memory"); }
};

struct LocalDeviceGroup {
    LocalDeviceGroup(int size, CudaLocalOptions o) : meet(size, o.timeout), options(o) {
        GRADSYNC_CUDA_CHECK(cudaSetDevice(o.device));
        GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    }
    LocalDeviceGroup(const LocalDeviceGroup&) = delete;
    LocalDeviceGroup& operator=(const LocalDeviceGroup&) = delete;
    ~LocalDeviceGroup() { cudaStreamDestroy(stream); }

    gradsync::detail::Rendezvous<LocalDeviceCall> meet;
    CudaLocalOptions options;
    cudaStream_t stream = nullptr;  // where rank 0 queues the group's device work
};

}  // namespace cuda::detail

// Handle to a CudaLocalBackend collective (the Waitable concept).
class CudaLocalHandle {
public:
    CudaLocalHandle() = default;  // an already completed no-op
    CudaLocalHandle(cuda::detail::SharedEvent done, std::shared_ptr<cuda::detail::LocalDeviceGroup> group,
                    std::string what)
        : done_(std::move(done)),
          group_(std::move(group)),
          what_(std::move(what)),
          deadline_(std::chrono::steady_clock::now() + group_->options.timeout) {}

    [[nodiscard]] bool ready() const {
        if (!done_ || group_->meet.failed()) return true;
        const cudaError_t code = cudaEventQuery(done_.get());
        if (code == cudaErrorNotReady) return false;
        if (code != cudaSuccess) cudaGetLastError();
        return true;
    }
    void wait() const { (void)wait_until(std::chrono::steady_clock::time_point::max()); }
    [[nodiscard]] bool wait_until(std::chrono::steady_clock::time_point deadline) const {
        if (!done_) return true;
        for (;;) {
            group_->meet.throw_if_failed();
            const cudaError_t code = cudaEventQuery(done_.get());
            if (code == cudaSuccess) return true;
            if (code != cudaErrorNotReady) GRADSYNC_CUDA_CHECK(code);
            const auto now = std::chrono::steady_clock::now();
            if (now >= deadline_) {
                group_->meet.abort("gradsync: " + what_ + " did not complete on the device within " +
                                   std::to_string(group_->options.timeout.count()) + " ms; the group was aborted");
                group_->meet.throw_if_failed();
            }
            if (now >= deadline) return false;
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }
    // Makes `stream` wait for this collective, without blocking the host.
    void then(cudaStream_t stream) const {
        if (done_) GRADSYNC_CUDA_CHECK(cudaStreamWaitEvent(stream, done_.get(), 0));
    }
    [[nodiscard]] std::chrono::steady_clock::time_point finished_at() const { return {}; }

private:
    cuda::detail::SharedEvent done_;
    std::shared_ptr<cuda::detail::LocalDeviceGroup> group_;
    std::string what_;
    std::chrono::steady_clock::time_point deadline_{};
};

class CudaLocalBackend : public detail::TypedCalls<CudaLocalBackend> {
public:
    using TypedCalls::allreduce;
    using TypedCalls::allreduce_async;
    using TypedCalls::broadcast;

    static constexpr bool device_memory = true;
    static constexpr bool checks_tags = true;  // every rendezvous compares the ranks' calls

    // A group of `size` ranks (1 to 8) on options.device; element r is rank r's handle, to be
    // driven by one thread each (cuda_local_spawn does that).
    static std::vector<CudaLocalBackend> create_group(int size, CudaLocalOptions options = {}) {
        if (size < 1 || size > cuda::detail::max_local_ranks)
            throw Error("gradsync: a CudaLocalBackend group has 1 to " + std::to_string(cuda::detail::max_local_ranks) +
                        " ranks, not " + std::to_string(size));
        auto group = std::make_shared<cuda::detail::LocalDeviceGroup>(size, options);
        std::vector<CudaLocalBackend> ranks;
        for (int r = 0; r < size; ++r) ranks.push_back(CudaLocalBackend(group, r));
        return ranks;
    }

    CudaLocalBackend(CudaLocalBackend&& o) noexcept
        : group_(std::move(o.group_)),
          rank_(o.rank_),
          compute_(o.compute_),
          ready_(std::exchange(o.ready_, nullptr)),
          calls_(o.calls_) {}
    CudaLocalBackend& operator=(CudaLocalBackend&&) = delete;
    CudaLocalBackend(const CudaLocalBackend&) = delete;
    CudaLocalBackend& operator=(const CudaLocalBackend&) = delete;
    ~CudaLocalBackend() {
        if (ready_ != nullptr) cudaEventDestroy(ready_);
    }

    [[nodiscard]] int rank() const { return rank_; }
    [[nodiscard]] int size() const { return group_->meet.size(); }
    [[nodiscard]] int device() const { return group_->options.device; }
    [[nodiscard]] bool supports(DType t) const {
        return t == DType::float32 || t == DType::float64 || t == DType::float16 || t == DType::bfloat16;
    }
    // The stream this rank's backward runs on; collectives are ordered after what it was given.
    void set_compute_stream(cudaStream_t stream) { compute_ = stream; }
    [[nodiscard]] cudaStream_t compute_stream() const { return compute_; }

    CudaLocalHandle allreduce_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        if (!supports(buf.dtype))
            throw CollectiveError(who() + ": cannot allreduce " + to_string(buf.dtype) +
                                  " (float32, float64, float16 and bfloat16 only)");
        cuda::detail::LocalDeviceCall call;
        call.kind = CollectiveKind::allreduce;
        call.seq = ++calls_;
        call.data = buf.data;
        call.count = buf.count;
        call.dtype = buf.dtype;
        call.op = op;
        call.tag = tag;
        return collective(call);
    }
    void allreduce(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        allreduce_async(buf, op, tag).wait();
    }

    CudaLocalHandle broadcast_async(std::span<std::byte> bytes, int root, CollectiveTag tag = {}) {
        if (root < 0 || root >= size())
            throw CollectiveError(who() + ": broadcast from rank " + std::to_string(root) +
                                  ", which is not in the group of " + std::to_string(size()));
        cuda::detail::LocalDeviceCall call;
        call.kind = CollectiveKind::broadcast;
        call.seq = ++calls_;
        call.data = bytes.data();
        call.count = bytes.size();
        call.root = root;
        call.tag = tag;
        return collective(call);
    }
    void broadcast(std::span<std::byte> bytes, int root, CollectiveTag tag = {}) {
        broadcast_async(bytes, root, tag).wait();
    }

    void barrier() {
        cuda::detail::LocalDeviceCall call;
        call.seq = ++calls_;
        (void)collective(call);
    }

    void wait_on_device(const CudaLocalHandle& handle) { handle.then(compute_); }
    void abort(const std::string& reason) { group_->meet.abort(reason); }
    void throw_if_failed() const { group_->meet.throw_if_failed(); }

private:
    CudaLocalBackend(std::shared_ptr<cuda::detail::LocalDeviceGroup> group, int rank)
        : group_(std::move(group)), rank_(rank) {}

    [[nodiscard]] std::string who() const {
        return gradsync::detail::rank_prefix(rank_, size(),
                                             "CUDA local group, GPU " + std::to_string(group_->options.device));
    }

    // Both rounds of a collective: publish the call (with an event on the compute stream), check
    // that every rank made the same one, do the work (rank 0 queues the device part), publish
    // its completion event, and hand it out.
    CudaLocalHandle collective(cuda::detail::LocalDeviceCall call) {
        GRADSYNC_CUDA_CHECK(cudaSetDevice(group_->options.device));
        const bool moves_data = call.kind != CollectiveKind::barrier && call.count != 0;
        call.on_device = moves_data && gradsync::detail::device_addressable(call.data);
        if (call.on_device) {
            if (ready_ == nullptr) GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
            GRADSYNC_CUDA_CHECK(cudaEventRecord(ready_, compute_));
            call.ready = ready_;
        }
        const std::string what = who() + ": " + call.what();
        const auto calls = group_->meet.arrive(rank_, call, who(), call.what());
        for (int r = 0; r < size(); ++r) {
            if (calls[std::size_t(r)].same_call(calls[0])) continue;
            const std::string reason =
                "gradsync: the ranks of a CUDA local group called different collectives: "
                "rank 0 " +
                calls[0].what() + "; rank " + std::to_string(r) + " " + calls[std::size_t(r)].what();
            group_->meet.abort(reason);
            group_->meet.throw_if_failed();
        }
        if (!moves_data) return CudaLocalHandle{};
        if (!call.on_device) {
            host_collective(calls);
            return CudaLocalHandle{};
        }
        cuda::detail::LocalDeviceCall second;
        if (rank_ == 0) second.done = queue_device_work(calls);
        const auto seconds = group_->meet.arrive(rank_, second, who(), call.what() + " (completion)");
        return CudaLocalHandle(seconds[0].done, group_, what);
    }

    cuda::detail::SharedEvent queue_device_work(std::span<const cuda::detail::LocalDeviceCall> calls) {
        auto& g = *group_;
        for (const auto& c : calls) GRADSYNC_CUDA_CHECK(cudaStreamWaitEvent(g.stream, c.ready, 0));
        const auto& first = calls[0];
        if (first.kind == CollectiveKind::allreduce) {
            cuda::detail::RankPointers ptrs{};
            for (std::size_t r = 0; r < calls.size(); ++r) ptrs.at[r] = calls[r].data;
            const std::uint64_t blocks = (first.count + 255) / 256;
            const unsigned grid = blocks < 1024 ? unsigned(blocks) : 1024u;
            const bool average = first.op == ReduceOp::average;
            gradsync::detail::visit_float_dtype(*first.dtype, [&]<class T>(gradsync::detail::type_tag<T>) {
                using A = cuda::detail::device_accumulator_t<T>;
                cuda::detail::reduce_ranks_kernel<T>
                    <<<grid, 256, 0, g.stream>>>(ptrs, size(), first.count, average, A(1) / static_cast<A>(size()));
            });
            GRADSYNC_CUDA_CHECK(cudaGetLastError());
        } else {
            for (std::size_t r = 0; r < calls.size(); ++r)
                if (int(r) != first.root)
                    GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(calls[r].data, calls[std::size_t(first.root)].data, first.count,
                                                        cudaMemcpyDeviceToDevice, g.stream));
        }
        auto done = cuda::detail::make_event();
        GRADSYNC_CUDA_CHECK(cudaEventRecord(done.get(), g.stream));
        return done;
    }

    // Host buffers (the library's control messages): every rank computes the result from every
    // rank's buffer, in rank order, waits until all have read, then writes its own.
    void host_collective(std::span<const cuda::detail::LocalDeviceCall> calls) {
        const auto& first = calls[0];
        void* mine = calls[std::size_t(rank_)].data;  // `calls` is not read after the next rendezvous
        const std::size_t bytes =
            first.kind == CollectiveKind::allreduce ? first.count * size_of(*first.dtype) : first.count;
        std::vector<std::byte> result(bytes);
        if (first.kind == CollectiveKind::allreduce) {
            gradsync::detail::AlignedBytes scratch(gradsync::detail::reduce_block_bytes);
            gradsync::detail::visit_float_dtype(*first.dtype, [&]<class T>(gradsync::detail::type_tag<T>) {
                std::vector<T*> inputs;
                for (const auto& c : calls) inputs.push_back(static_cast<T*>(c.data));
                T* out = reinterpret_cast<T*>(result.data());
                using A = gradsync::detail::accumulator_t<T>;
                gradsync::detail::reduce_to_all<T>(inputs.data(), size(), &out, 1, first.count,
                                                   first.op == ReduceOp::average, A(1) / static_cast<A>(size()),
                                                   scratch.data());
            });
        } else {
            std::memcpy(result.data(), calls[std::size_t(first.root)].data, bytes);
        }
        const std::string what = first.what() + " (read)";
        (void)group_->meet.arrive(rank_, cuda::detail::LocalDeviceCall{}, who(), what);
        std::memcpy(mine, result.data(), bytes);
    }

    std::shared_ptr<cuda::detail::LocalDeviceGroup> group_;
    int rank_ = 0;
    cudaStream_t compute_ = nullptr;
    cudaEvent_t ready_ = nullptr;  // re-recorded at each collective: rank 0 has waited on it by then
    std::uint64_t calls_ = 0;      // collectives called, to number them
};

// Calls fn(CudaLocalBackend&) once per rank of a new group on one GPU, each on its own thread
// with the device current, and joins them. A rank that throws aborts the group, so that peers
// fail at once; the first exception is rethrown.
template <class Fn>
requires std::is_invocable_v<const Fn&, CudaLocalBackend&>
void cuda_local_spawn(int n, const Fn& fn, CudaLocalOptions options = {}) {
    auto ranks = CudaLocalBackend::create_group(n, options);
    gradsync::detail::FirstError errors;
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            auto& backend = ranks[std::size_t(r)];
            try {
                GRADSYNC_CUDA_CHECK(cudaSetDevice(options.device));
                fn(backend);
            } catch (...) {
                backend.abort(gradsync::detail::rank_prefix(r) + " threw: " + errors.keep_current());
            }
        });
    }
    for (auto& t : threads) t.join();
    errors.rethrow_if_any();
}

}  // namespace gradsync::inline v0
