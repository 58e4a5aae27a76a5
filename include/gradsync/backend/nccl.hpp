// NcclBackend<Algo>: gradsync's collectives over NCCL, one rank per GPU. A collective is queued
// on the backend's communication stream, behind the work already queued on the trainer's compute
// stream, and returns at once; its handle completes when the stream has done it. The communicator is non-blocking, and
// a watchdog aborts it (ncclCommAbort) when a collective misses its deadline or NCCL reports an asynchronous error, so
// that every pending and later call throws, naming the rank, the operation and NCCL's words, instead of hanging.
// Buffers in host memory (the library's small control messages: layout agreement, barriers) are staged through a fixed
// device buffer, piece by piece. Every thread that touches the GPU for this backend (the watchdog's included) selects
// the rank's device first, so no process creates a context on a GPU it does not drive. Not included by
// <gradsync/gradsync.hpp>: needs <nccl.h>, the CUDA runtime and NCCL's library.
//
//   auto place = gradsync::nccl_place_from_environment();  // torchrun-style variables
//   gradsync::NcclBackend<> backend(place);
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/detail/typed_calls.hpp>
#include <gradsync/backend/detail/watchdog.hpp>
#include <gradsync/backend/group_label.hpp>
#include <gradsync/backend/nccl/algorithm.hpp>
#include <gradsync/backend/nccl/communicator.hpp>
#include <gradsync/backend/nccl/handle.hpp>
#include <gradsync/backend/nccl/join.hpp>
#include <gradsync/backend/nccl/options.hpp>
#include <gradsync/backend/nccl/peer_board.hpp>
#include <gradsync/backend/nccl/place.hpp>
#include <gradsync/backend/nccl/queue.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>  // for std::min
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>     // for std::memcpy
#include <functional>  // for std::function
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <thread>
#include <type_traits>  // for std::conditional_t, std::is_same_v
#include <utility>      // for std::exchange
#include <vector>

namespace gradsync::inline v0 {

template <class Algo = nccl::Auto>
class NcclBackend : public detail::TypedCalls<NcclBackend<Algo>> {
    using Typed = detail::TypedCalls<NcclBackend<Algo>>;

public:
    using Typed::all_gather;
    using Typed::all_gather_async;
    using Typed::allreduce;
    using Typed::allreduce_async;
    using Typed::broadcast;
    using Typed::reduce_scatter;
    using Typed::reduce_scatter_async;
    using algorithm = Algo;
    static constexpr bool device_memory = true;  // collectives take device (or managed) memory
    // Host buffers are staged through device memory in pieces of at most this size.
    static constexpr std::size_t staging_bytes = detail::nccl_staging_bytes;

    // Joins the communicator of `place` (nccl_place_from_environment()): selects its device,
    // creates a non-blocking communicator and waits until every rank has joined, by the
    // timeout. Every rank must construct its backend; one that never does ends the others' wait
    // at the deadline with a TimeoutError.
    explicit NcclBackend(const NcclPlace& place, NcclOptions options = {})
        : NcclBackend(place.place.rank, place.place.world_size, place.device, place.id, options) {}

    // Rank `rank` of `size` on CUDA device `device`, all ranks with the same `id`.
    NcclBackend(int rank, int size, int device, const ncclUniqueId& id, NcclOptions options = {})
        : NcclBackend(rank, size, device, options, GroupLabel{}, board_key(id), [&id](State& s, ncclConfig_t* config) {
              return ncclCommInitRankConfig(&s.comm, s.size, id, s.rank, config);
          }) {}

    // A backend over a group of `parent`'s ranks (ncclCommSplit): those of the same `colour`
    // (at least 0), numbered by `key`, then by rank in `parent`, on `parent`'s GPU. Collective
    // over `parent`: every one of its ranks makes its own, while nothing else runs on it. Its
    // messages name `group_name` and the group's job ranks.
    NcclBackend(NcclBackend& parent, int colour, int key, NcclOptions options = {}, std::string group_name = {})
        : NcclBackend(split_place(parent, colour, key, std::move(group_name)), parent, colour, key, options) {}

    NcclBackend(NcclBackend&&) noexcept = default;
    NcclBackend& operator=(NcclBackend&&) = delete;
    NcclBackend(const NcclBackend&) = delete;
    NcclBackend& operator=(const NcclBackend&) = delete;

    // Flushes the communicator (ncclCommFinalize, by the pending collectives' deadlines) and frees
    // it; a failed or late one is aborted instead, and so is one with a collective nobody waits for
    // (neither the host nor a stream: abandoned by an exception), whose peers may never come.
    ~NcclBackend() {
        if (!state_) return;
        try {
            state_->close();
        } catch (...) {  // a destructor must not throw
        }
    }

    [[nodiscard]] int rank() const { return state_->rank; }
    [[nodiscard]] int size() const { return state_->size; }
    [[nodiscard]] int device() const { return state_->device; }
    [[nodiscard]] cudaStream_t stream() const { return state_->stream; }
    [[nodiscard]] cudaStream_t compute_stream() const { return state_->compute; }
    [[nodiscard]] ncclComm_t comm() const { return state_->comm; }
    // Which ranks of the job the communicator holds (a split's group; the whole job otherwise).
    [[nodiscard]] const GroupLabel& group() const { return label_; }
    [[nodiscard]] bool supports(DType t) const {
        return t == DType::float32 || t == DType::float64 || t == DType::float16 || t == DType::bfloat16;
    }

    // Sum or average (ncclAvg: NCCL folds the 1/size into the reduction) of `buf` over the
    // ranks, in place.
    NcclHandle allreduce_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        const ncclDataType_t type = reducible_type(buf.dtype, "allreduce");
        const ncclRedOp_t nop = op == ReduceOp::average ? ncclAvg : ncclSum;
        return queue(allreduce_call(buf, op, tag), buf.data, [&](void* data, std::size_t count, State& s) {
            return ncclAllReduce(data, data, count, type, nop, s.comm, s.stream);
        });
    }
    void allreduce(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        allreduce_async(buf, op, tag).wait();
    }

    // The sum over the ranks of `factor` times each rank's `buf`, in one pass (NCCL's
    // pre-multiplied sum): folds an unscaling factor such as 1/(size * loss scale) into the
    // reduction. Exact where the factor is a power of two.
    NcclHandle allreduce_scaled_async(Buffer buf, double factor, CollectiveTag tag = {}) {
        const ncclDataType_t type = reducible_type(buf.dtype, "allreduce");
        return queue(allreduce_call(buf, ReduceOp::sum, tag), buf.data, [&](void* data, std::size_t count, State& s) {
            ncclRedOp_t op{};
            const auto scalar = scalar_of(buf.dtype, factor);
            ncclResult_t r = ncclRedOpCreatePreMulSum(&op, const_cast<std::byte*>(scalar.data()), type,
                                                      ncclScalarHostImmediate, s.comm);
            if (r != ncclSuccess) return r;
            r = ncclAllReduce(data, data, count, type, op, s.comm, s.stream);
            // Allowed as soon as the last call given the operator has returned.
            const ncclResult_t destroyed = ncclRedOpDestroy(op, s.comm);
            return r != ncclSuccess ? r : destroyed;
        });
    }

    // Leaves the sum or average over the ranks in this rank's shard of `buf` (shard_of(buf.count,
    // size(), rank())), ordered like the allreduce; the rest of `buf` is unspecified. Device
    // memory only. Shards of one length: one in-place ncclReduceScatter; of two lengths (a count
    // the ranks do not divide): one ncclReduce per shard to its owner, in one group.
    NcclHandle reduce_scatter_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        const ncclDataType_t type = reducible_type(buf.dtype, "reduce_scatter");
        const ncclRedOp_t nop = op == ReduceOp::average ? ncclAvg : ncclSum;
        require_device(buf, "reduce_scatter");
        const int n = size(), me = rank();
        const std::size_t elem = size_of(buf.dtype);
        return queue(sharded_call(CollectiveKind::reduce_scatter, buf, op, tag), buf.data,
                     [&](void* data, std::size_t count, State& s) -> ncclResult_t {
                         auto* base = static_cast<std::byte*>(data);
                         if (count % std::size_t(n) == 0) {
                             const Shard mine = shard_of(count, n, me);
                             return ncclReduceScatter(base, base + mine.offset * elem, mine.count, type, nop, s.comm,
                                                      s.stream);
                         }
                         return detail::nccl_grouped(n, count, [&](int owner, Shard shard) {
                             std::byte* at = base + shard.offset * elem;
                             return ncclReduce(at, at, shard.count, type, nop, owner, s.comm, s.stream);
                         });
                     });
    }
    void reduce_scatter(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        reduce_scatter_async(buf, op, tag).wait();
    }

    // Copies every rank's shard of its `buf` into the same place of every other rank's (any
    // dtype, device memory only): one in-place ncclAllGather where the shards have one length,
    // else one ncclBroadcast per shard from its owner, in one group.
    NcclHandle all_gather_async(Buffer buf, CollectiveTag tag = {}) {
        require_device(buf, "all_gather");
        const int n = size(), me = rank();
        const std::size_t elem = size_of(buf.dtype);
        return queue(sharded_call(CollectiveKind::all_gather, buf, ReduceOp::sum, tag), buf.data,
                     [&](void* data, std::size_t count, State& s) -> ncclResult_t {
                         auto* base = static_cast<std::byte*>(data);
                         if (count % std::size_t(n) == 0) {
                             const Shard mine = shard_of(count, n, me);
                             return ncclAllGather(base + mine.offset * elem, base, mine.count * elem, ncclUint8, s.comm,
                                                  s.stream);
                         }
                         return detail::nccl_grouped(n, count, [&](int owner, Shard shard) {
                             std::byte* at = base + shard.offset * elem;
                             return ncclBroadcast(at, at, shard.count * elem, ncclUint8, owner, s.comm, s.stream);
                         });
                     });
    }
    void all_gather(Buffer buf, CollectiveTag tag = {}) { all_gather_async(buf, tag).wait(); }

    // Copies `root`'s bytes to every rank.
    NcclHandle broadcast_async(std::span<std::byte> bytes, int root, CollectiveTag tag = {}) {
        check_root(root);
        const CollectiveCall call{
            .kind = CollectiveKind::broadcast, .seq = ++state_->calls, .count = bytes.size(), .root = root, .tag = tag};
        return queue(call, bytes.data(), [&](void* data, std::size_t count, State& s) {
            return ncclBroadcast(data, data, count, ncclUint8, root, s.comm, s.stream);
        });
    }
    void broadcast(std::span<std::byte> bytes, int root, CollectiveTag tag = {}) {
        broadcast_async(bytes, root, tag).wait();
    }

    // Returns when every rank has reached it (an allreduce of one value), by the timeout.
    void barrier() {
        float one = 1;
        allreduce(Buffer{&one, 1, DType::float32}, ReduceOp::sum);
    }

    // Throws the communicator's failure, if the watchdog or a waiter found one: how a rank whose
    // host never waits for a collective still learns of it.
    void throw_if_failed() const { state_->watchdog->rethrow_if_failed(); }

    // Orders later collectives after `stream` instead (between steps, not while one is queued).
    void set_compute_stream(cudaStream_t stream) { state_->compute = stream; }

    // Makes the compute stream wait for the collective, without blocking the host: what the
    // trainer queues next on it sees the reduced values.
    void wait_on_device(const NcclHandle& handle) { handle.then(state_->compute); }

    // Fails every pending and later collective of this rank with `reason` and aborts the
    // communicator, so that this rank stops waiting for its peers; from any thread, at once (a
    // call that is being queued ends at its next poll and the abort follows). Peers learn of it
    // through their own deadline or NCCL's error.
    void abort(const std::string& reason) { state_->watchdog->fail(reason); }

    // A reporter of where this rank stands (DataParallel leaves one), quoted when a collective of
    // a peer that shares this process (nccl_spawn) misses its deadline, beside how many
    // collectives each has entered; removed by id. NCCL's host side cannot see other processes.
    std::uint64_t add_status_reporter(std::function<std::string()> reporter) {
        return state_->board->add_reporter(rank(), std::move(reporter));
    }
    void remove_status_reporter(std::uint64_t id) { state_->board->remove_reporter(rank(), id); }

private:
    using State = detail::NcclCommunicator;

    NcclBackend(detail::NcclSplitPlace place, NcclBackend& parent, int colour, int key, NcclOptions options)
        : NcclBackend(place.rank, place.size, parent.device(), options, std::move(place.label),
                      parent.board_key_ + "/" + std::to_string(colour),
                      [comm = parent.comm(), colour, key](State& s, ncclConfig_t* config) {
                          return ncclCommSplit(comm, colour, key, &s.comm, config);
                      }) {}

    // Selects the device, makes the streams, staging buffers and watchdog, then the communicator
    // through `make(state, config)`, and waits until every rank has joined it.
    template <class Make>
    NcclBackend(int rank, int size, int device, NcclOptions options, GroupLabel label, std::string board_key, Make make)
        : state_(std::make_unique<State>()), label_(std::move(label)), board_key_(std::move(board_key)) {
        auto& s = *state_;
        s.rank = rank;
        s.size = size;
        s.device = device;
        s.timeout = options.timeout;
        const std::string gpu = "NCCL, GPU " + std::to_string(device);
        s.who = label_.whole_job() ? detail::rank_prefix(rank, size, gpu) : label_.who(rank) + " on " + gpu;
        if (size < 1 || rank < 0 || rank >= size)
            throw Error(s.who + ": the rank must be at least 0 and below the world size, which must be at least 1");
        try {
            GRADSYNC_CUDA_CHECK(cudaSetDevice(device));
        } catch (const CudaError& e) {
            throw CudaError(s.who + ": cannot use CUDA device " + std::to_string(device) + ": " + e.what(), e.code());
        }
        try {
            s.compute = options.compute_stream;
            GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&s.computed, cudaEventDisableTiming));
            if (options.stream != nullptr) {
                s.stream = options.stream;
            } else {
                GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
                s.own_stream = true;
            }
            // Allocated once: growing it later would have to wait for the stream.
            GRADSYNC_CUDA_CHECK(cudaMalloc(&s.scratch, staging_bytes));
            GRADSYNC_CUDA_CHECK(cudaMallocHost(&s.pinned, staging_bytes));
            s.watchdog = std::make_shared<detail::Watchdog>(s.who, detail::watched_device(&s));
            // Abortable from here on, through abort() or the stop token, even while joining.
            if (options.stop.stop_possible()) s.on_stop.emplace(options.stop, detail::NcclStopRequest{&s});
            detail::nccl_join(
                s, Algo::allreduce, [&](ncclConfig_t* config) { return make(s, config); },
                "a rank did not start, failed before joining, or was given a different NCCL_COMM_ID "
                "(MASTER_ADDR/MASTER_PORT), world size or group");
            s.board = detail::NcclPeerBoard::of(board_key_, size);
            s.board->join(rank, &s.calls);
            s.watchdog->start(options.watchdog_period);
        } catch (...) {
            try {
                s.close();  // no destructor runs for a constructor that throws
            } catch (...) {
            }
            throw;
        }
    }

    // Every rank's colour and key, agreed over `parent` before NCCL splits it.
    static detail::NcclSplitPlace split_place(NcclBackend& parent, int colour, int key, std::string name) {
        if (colour < 0)
            throw Error(parent.state_->who + ": a group's colour must be at least 0, got " + std::to_string(colour));
        const auto n = static_cast<std::size_t>(parent.size()), me = static_cast<std::size_t>(parent.rank());
        std::vector<double> colours(n, 0.0), keys(n, 0.0);
        colours[me] = colour;
        keys[me] = key;
        parent.allreduce(std::span<double>(colours));
        parent.allreduce(std::span<double>(keys));
        return detail::nccl_split_place(colours, keys, parent.rank(), parent.label_, std::move(name));
    }

    // The communicator's name among this process's boards: its unique id's bytes.
    static std::string board_key(const ncclUniqueId& id) {
        return std::string(reinterpret_cast<const char*>(&id), sizeof id);
    }

    ncclDataType_t reducible_type(DType t, const char* what) const {
        if (!supports(t))
            throw CollectiveError(state_->who + ": cannot " + what + " " + to_string(t) +
                                  " (float32, float64, float16 and bfloat16 only)");
        return *detail::nccl_type(t);
    }

    void check_root(int root) const {
        if (root < 0 || root >= state_->size)
            throw CollectiveError(state_->who + ": broadcast from rank " + std::to_string(root) +
                                  ", which is not in the group of " + std::to_string(state_->size));
    }

    // The factor in `t`'s representation, for a pre-multiplied sum.
    static std::vector<std::byte> scalar_of(DType t, double factor) {
        std::vector<std::byte> out(size_of(t));
        detail::visit_float_dtype(t, [&]<class T>(detail::type_tag<T>) {
            using Wide = std::conditional_t<std::is_same_v<T, double>, double, float>;
            const T value(static_cast<Wide>(factor));
            std::memcpy(out.data(), &value, sizeof value);
        });
        return out;
    }

    CollectiveCall sharded_call(CollectiveKind kind, Buffer buf, ReduceOp op, CollectiveTag tag) {
        CollectiveCall call = allreduce_call(buf, op, tag);
        call.kind = kind;
        return call;
    }

    // The host staging buffer goes piece by piece, which would shard each piece, not the buffer.
    void require_device(Buffer buf, const char* what) const {
        if (buf.count != 0 && !detail::device_addressable(buf.data))
            throw CollectiveError(state_->who + ": " + what +
                                  " takes device (or managed) memory; this buffer lies in host memory");
    }

    CollectiveCall allreduce_call(Buffer buf, ReduceOp op, CollectiveTag tag) {
        return CollectiveCall{.kind = CollectiveKind::allreduce,
                              .seq = ++state_->calls,
                              .count = buf.count,
                              .dtype = buf.dtype,
                              .op = op,
                              .tag = tag};
    }

    // Queues `call` on the memory at `data` (see nccl/queue.hpp).
    template <class Issue>
    NcclHandle queue(const CollectiveCall& call, void* data, Issue&& issue) {
        return detail::nccl_queue(*state_, call, data, issue);
    }

    std::unique_ptr<State> state_;
    GroupLabel label_;
    std::string board_key_;
};

}  // namespace gradsync::inline v0
