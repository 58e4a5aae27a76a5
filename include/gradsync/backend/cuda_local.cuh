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
#include <gradsync/backend/cuda_local/group.cuh>
#include <gradsync/backend/cuda_local/kernels.cuh>
#include <gradsync/bytes.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/cuda/convert.cuh>
#include <gradsync/detail/aligned_bytes.hpp>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/detail/first_error.hpp>
#include <gradsync/detail/host_reduce.hpp>
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

class CudaLocalBackend : public detail::TypedCalls<CudaLocalBackend> {
public:
    using TypedCalls::all_gather;
    using TypedCalls::all_gather_async;
    using TypedCalls::allreduce;
    using TypedCalls::allreduce_async;
    using TypedCalls::broadcast;
    using TypedCalls::reduce_scatter;
    using TypedCalls::reduce_scatter_async;

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
        return collective(reduction_call(CollectiveKind::allreduce, buf, op, tag));
    }
    void allreduce(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        allreduce_async(buf, op, tag).wait();
    }

    // This rank's shard (shard_of) of `buf` ends with the reduction, bitwise the allreduce's there;
    // the rest of `buf` is left as it was.
    CudaLocalHandle reduce_scatter_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        return collective(reduction_call(CollectiveKind::reduce_scatter, buf, op, tag));
    }
    void reduce_scatter(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        reduce_scatter_async(buf, op, tag).wait();
    }

    // Copies every rank's shard of its `buf` into the same place of every other rank's (any dtype).
    CudaLocalHandle all_gather_async(Buffer buf, CollectiveTag tag = {}) {
        cuda::detail::LocalDeviceCall call;
        call.kind = CollectiveKind::all_gather;
        call.seq = ++calls_;
        call.data = buf.data;
        call.count = buf.count;
        call.dtype = buf.dtype;
        call.tag = tag;
        return collective(call);
    }
    void all_gather(Buffer buf, CollectiveTag tag = {}) { all_gather_async(buf, tag).wait(); }

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

    cuda::detail::LocalDeviceCall reduction_call(CollectiveKind kind, Buffer buf, ReduceOp op, CollectiveTag tag) {
        if (!supports(buf.dtype))
            throw CollectiveError(who() + ": cannot " + to_string(kind) + " " + to_string(buf.dtype) +
                                  " (float32, float64, float16 and bfloat16 only)");
        cuda::detail::LocalDeviceCall call;
        call.kind = kind;
        call.seq = ++calls_;
        call.data = buf.data;
        call.count = buf.count;
        call.dtype = buf.dtype;
        call.op = op;
        call.tag = tag;
        return call;
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
        if (first.kind == CollectiveKind::allreduce || first.kind == CollectiveKind::reduce_scatter) {
            cuda::detail::RankPointers ptrs{};
            for (std::size_t r = 0; r < calls.size(); ++r) ptrs.at[r] = calls[r].data;
            const std::uint64_t blocks = (first.count + 255) / 256;
            const unsigned grid = blocks < 1024 ? unsigned(blocks) : 1024u;
            const bool average = first.op == ReduceOp::average;
            gradsync::detail::visit_float_dtype(*first.dtype, [&]<class T>(gradsync::detail::type_tag<T>) {
                using A = cuda::detail::device_accumulator_t<T>;
                cuda::detail::reduce_ranks_kernel<T>
                    <<<grid, 256, 0, g.stream>>>(ptrs, size(), first.count, average, A(1) / static_cast<A>(size()),
                                                 first.kind == CollectiveKind::reduce_scatter);
            });
            GRADSYNC_CUDA_CHECK(cudaGetLastError());
        } else if (first.kind == CollectiveKind::all_gather) {
            const std::size_t elem = size_of(*first.dtype);
            for (int from = 0; from < size(); ++from) {
                const Shard shard = shard_of(first.count, size(), from);
                const auto* src = static_cast<const std::byte*>(calls[std::size_t(from)].data) + shard.offset * elem;
                for (int to = 0; to < size(); ++to)
                    if (to != from && shard.count != 0)
                        GRADSYNC_CUDA_CHECK(
                            cudaMemcpyAsync(static_cast<std::byte*>(calls[std::size_t(to)].data) + shard.offset * elem,
                                            src, shard.count * elem, cudaMemcpyDeviceToDevice, g.stream));
            }
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
        const std::size_t elem = first.dtype ? size_of(*first.dtype) : 1;
        const std::size_t bytes = first.count * elem;
        std::vector<std::byte> result(bytes);
        // What this rank writes: all of it, or its shard after a reduce_scatter.
        Shard written{0, first.count};
        if (first.kind == CollectiveKind::reduce_scatter) written = shard_of(first.count, size(), rank_);
        if (first.kind == CollectiveKind::allreduce || first.kind == CollectiveKind::reduce_scatter) {
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
        } else if (first.kind == CollectiveKind::all_gather) {
            for (int from = 0; from < size(); ++from) {
                const Shard shard = shard_of(first.count, size(), from);
                if (shard.count != 0)
                    std::memcpy(result.data() + shard.offset * elem,
                                static_cast<const std::byte*>(calls[std::size_t(from)].data) + shard.offset * elem,
                                shard.count * elem);
            }
        } else {
            std::memcpy(result.data(), calls[std::size_t(first.root)].data, bytes);
        }
        const std::string what = first.what() + " (read)";
        (void)group_->meet.arrive(rank_, cuda::detail::LocalDeviceCall{}, who(), what);
        if (written.count != 0)
            std::memcpy(static_cast<std::byte*>(mine) + written.offset * elem, result.data() + written.offset * elem,
                        written.count * elem);
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
