// SharedMemoryBackend: the ranks are processes of one machine (or threads: any mix) and the
// collectives run through a shared-memory object they all map, without a transport library in
// between. Each rank constructs its own with the group's name, its rank and the group's size;
// the constructor returns once every rank has mapped the object.
//
//   gradsync::SharedMemoryBackend backend("/myjob-node0", local_rank, local_size);
//   gradsync::DataParallel dp(model, backend);
//
// Sums run in rank order (0, 1, 2, ...), so results are bitwise those of LocalBackend on the same
// inputs, whatever the plan. A rank that fails a collective, is destroyed, or whose process exits
// fails every peer's pending and later collectives (no wait for the deadline where the peer's
// departure or death can be seen).
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/detail/async_collectives.hpp>
#include <gradsync/backend/detail/held_segments.hpp>
#include <gradsync/backend/detail/shared_collectives.hpp>
#include <gradsync/backend/detail/typed_calls.hpp>
#include <gradsync/backend/handle.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>  // for std::move

namespace gradsync::inline v0 {

struct SharedMemoryOptions {
    // Each rank's staging slot (it has two): the unit a collective is cut into. Small enough to
    // stay in cache, large enough that the two meetings per slot cost little (2 processes on a
    // 2-core VM: 64 KiB 22 ms, 256 KiB 19 ms, 1 MiB 21 ms for 97.5 MiB).
    Bytes slot = Bytes{256u << 10};
    // Every wait inside a collective, and the constructor's wait for the other ranks, ends by then.
    std::chrono::milliseconds timeout = std::chrono::seconds(600);
};

class SharedMemoryBackend : public detail::TypedCalls<SharedMemoryBackend> {
public:
    using TypedCalls::all_gather;
    using TypedCalls::all_gather_async;
    using TypedCalls::allreduce;
    using TypedCalls::allreduce_async;
    using TypedCalls::broadcast;
    using TypedCalls::reduce_scatter;
    using TypedCalls::reduce_scatter_async;

    static constexpr bool checks_tags = true;  // every collective's tag is compared with rank 0's
    // Every element is summed rank 0, 1, 2, ... (detail/host_reduce.hpp), as LocalBackend sums.
    static constexpr bool sums_in_rank_order = true;

    // `name`: the shared-memory object's, "/" and up to 254 more characters, none of them "/",
    // the same on every rank of the group and unique among the machine's running groups (say,
    // from the launcher's job id). Rank 0 creates it; the name is removed once every rank has
    // mapped it.
    SharedMemoryBackend(const std::string& name, int rank, int size, SharedMemoryOptions options = {})
        : options_(check(name, rank, size, options)),
          group_(std::make_shared<detail::SharedGroup>(name, rank, size, options.slot.count(), options.timeout)) {}
    SharedMemoryBackend(const SharedMemoryBackend&) = delete;
    SharedMemoryBackend& operator=(const SharedMemoryBackend&) = delete;
    // Finishes this rank's pending collectives, then leaves: peers still waiting for it fail at once.
    ~SharedMemoryBackend() {
        async_.stop();
        group_->depart();
    }

    [[nodiscard]] int rank() const { return group_->segment().rank(); }
    [[nodiscard]] int size() const { return group_->segment().size(); }
    // float32, float64, and float16 and bfloat16 (summed in float).
    [[nodiscard]] bool supports(DType t) const { return detail::reducible(t); }
    [[nodiscard]] const SharedMemoryOptions& options() const { return options_; }
    [[nodiscard]] const std::string& name() const { return group_->segment().name(); }
    // The shared memory the whole group maps (this rank's slots and everyone's), in bytes.
    [[nodiscard]] Bytes shared_bytes() const { return Bytes{group_->segment().mapped_bytes()}; }
    [[nodiscard]] std::uint64_t calls_made() const { return next_seq_; }

    // In-place allreduce of a contiguous buffer. The tag, when given, must match on every rank.
    void allreduce(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        run_now(CollectiveKind::allreduce, buf, op, tag);
    }
    CollectiveHandle allreduce_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        return launch(CollectiveKind::allreduce, buf, op, tag);
    }
    // In-place allreduce of the concatenation of `segments`: gradients reduced where they lie,
    // with no bucket buffer. The segments must stay valid until the collective completes.
    void allreduce(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum,
                   CollectiveTag tag = {}) {
        run_now(CollectiveKind::allreduce, segments, dtype, op, tag);
    }
    CollectiveHandle allreduce_async(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum,
                                     CollectiveTag tag = {}) {
        return launch(CollectiveKind::allreduce, segments, dtype, op, tag);
    }

    // Leaves the reduction over the ranks in this rank's shard of `buf` (shard_of(buf.count, size(),
    // rank())), bitwise the allreduce's there; the rest of `buf` is left as it was.
    void reduce_scatter(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        run_now(CollectiveKind::reduce_scatter, buf, op, tag);
    }
    CollectiveHandle reduce_scatter_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        return launch(CollectiveKind::reduce_scatter, buf, op, tag);
    }
    void reduce_scatter(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum,
                        CollectiveTag tag = {}) {
        run_now(CollectiveKind::reduce_scatter, segments, dtype, op, tag);
    }
    CollectiveHandle reduce_scatter_async(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum,
                                          CollectiveTag tag = {}) {
        return launch(CollectiveKind::reduce_scatter, segments, dtype, op, tag);
    }

    // Copies every rank's shard of its `buf` into the same place of every other rank's.
    void all_gather(Buffer buf, CollectiveTag tag = {}) {
        run_now(CollectiveKind::all_gather, buf, ReduceOp::sum, tag);
    }
    CollectiveHandle all_gather_async(Buffer buf, CollectiveTag tag = {}) {
        return launch(CollectiveKind::all_gather, buf, ReduceOp::sum, tag);
    }
    void all_gather(std::span<const Segment> segments, DType dtype, CollectiveTag tag = {}) {
        run_now(CollectiveKind::all_gather, segments, dtype, ReduceOp::sum, tag);
    }
    CollectiveHandle all_gather_async(std::span<const Segment> segments, DType dtype, CollectiveTag tag = {}) {
        return launch(CollectiveKind::all_gather, segments, dtype, ReduceOp::sum, tag);
    }

    // Copies `root`'s bytes into every other rank's buffer of the same size.
    void broadcast(std::span<std::byte> bytes, int root, CollectiveTag tag = {}) {
        const Segment seg{bytes.data(), bytes.size()};
        run_now(call(CollectiveKind::broadcast, bytes.size(), std::nullopt, ReduceOp::sum, root, tag), {&seg, 1});
    }

    void barrier() { run_now(call(CollectiveKind::barrier, 0, std::nullopt, ReduceOp::sum, 0, {}), {}); }

    // Fails every pending and later collective of every rank of the group, with `reason`.
    void abort(const std::string& reason) { group_->abort(reason); }
    // Throws the abort's reason once the group was aborted (HealthPolling).
    void throw_if_failed() const {
        CollectiveCall none;
        none.seq = next_seq_;
        group_->throw_if_aborted(none);
    }

private:
    static SharedMemoryOptions check(const std::string& name, int rank, int size, SharedMemoryOptions options) {
        const std::string who = "gradsync: SharedMemoryBackend";
        if (size < 1) throw Error(who + " needs a group of at least 1 rank, got " + std::to_string(size));
        if (rank < 0 || rank >= size)
            throw Error(who + ": rank " + std::to_string(rank) + " is not in a group of " + std::to_string(size));
        if (name.size() < 2 || name.size() > 255 || name[0] != '/' || name.find('/', 1) != std::string::npos)
            throw Error(who + ": the name must be \"/\" and 1 to 254 more characters, none of them \"/\"; got \"" +
                        name + "\"");
        if (options.timeout.count() <= 0)
            throw Error(who + ": SharedMemoryOptions::timeout must be positive, got " +
                        std::to_string(options.timeout.count()) + " ms");
        if (options.slot.count() < 4096 || options.slot.count() % 64 != 0)
            throw Error(who + ": SharedMemoryOptions::slot must be a multiple of 64 bytes of at least 4 KiB, got " +
                        to_string(options.slot));
        return options;
    }

    CollectiveCall call(CollectiveKind kind, std::size_t count, std::optional<DType> dtype, ReduceOp op, int root,
                        CollectiveTag tag) {
        CollectiveCall c;
        c.kind = kind;
        c.seq = ++next_seq_;
        c.count = count;
        c.dtype = dtype;
        c.op = op;
        c.root = root;
        c.tag = tag;
        return c;
    }

    // Synchronous calls run on the caller's thread, after the rank's pending asynchronous ones.
    void run_now(const CollectiveCall& c, std::span<const Segment> segments) {
        async_.wait_for_all();
        group_->execute({c, segments});
    }
    void run_now(CollectiveKind kind, Buffer buf, ReduceOp op, CollectiveTag tag) {
        const Segment seg{buf.data, buf.count};
        run_now(call(kind, buf.count, buf.dtype, op, 0, tag), {&seg, 1});
    }
    void run_now(CollectiveKind kind, std::span<const Segment> segments, DType dtype, ReduceOp op, CollectiveTag tag) {
        run_now(call(kind, detail::total_count(segments), dtype, op, 0, tag), segments);
    }

    CollectiveHandle launch(const CollectiveCall& c, detail::HeldSegments segments) {
        auto done = std::make_shared<detail::Completion>(waiting_);
        async_.launch(
            [group = group_, c, segments = std::move(segments)] {
                group->execute({c, segments.get()});
            },
            done);
        return CollectiveHandle(std::move(done));
    }
    CollectiveHandle launch(CollectiveKind kind, Buffer buf, ReduceOp op, CollectiveTag tag) {
        return launch(call(kind, buf.count, buf.dtype, op, 0, tag), detail::HeldSegments(Segment{buf.data, buf.count}));
    }
    CollectiveHandle launch(CollectiveKind kind, std::span<const Segment> segments, DType dtype, ReduceOp op,
                            CollectiveTag tag) {
        return launch(call(kind, detail::total_count(segments), dtype, op, 0, tag), detail::HeldSegments(segments));
    }

    SharedMemoryOptions options_;
    std::shared_ptr<detail::SharedGroup> group_;
    std::uint64_t next_seq_ = 0;
    detail::AsyncCollectives async_;
    std::shared_ptr<detail::SpinBudget> waiting_ = std::make_shared<detail::SpinBudget>();  // for handles
};

}  // namespace gradsync::inline v0
