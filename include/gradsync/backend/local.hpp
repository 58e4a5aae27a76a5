// LocalBackend: ranks are threads of one process and collectives run in shared memory. A group
// of N yields N rank handles; each is driven by one thread (launch/spawn.hpp does this for you).
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/detail/async_collectives.hpp>
#include <gradsync/backend/detail/local_collectives.hpp>
#include <gradsync/backend/detail/typed_calls.hpp>
#include <gradsync/backend/group_label.hpp>
#include <gradsync/backend/handle.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>  // for std::function
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>  // for std::is_trivially_copyable_v
#include <utility>      // for std::move
#include <vector>

namespace gradsync::inline v0 {

class LocalBackend : public detail::TypedCalls<LocalBackend> {
public:
    using TypedCalls::all_gather;
    using TypedCalls::all_gather_async;
    using TypedCalls::allreduce;
    using TypedCalls::allreduce_async;
    using TypedCalls::broadcast;
    using TypedCalls::reduce_scatter;
    using TypedCalls::reduce_scatter_async;

    static constexpr bool checks_tags = true;  // every collective's tag is compared with rank 0's
    // Every element is summed rank 0, 1, 2, ... whatever the plan (detail/host_reduce.hpp).
    static constexpr bool sums_in_rank_order = true;

    // A group of `size` ranks; element r is rank r's handle. Hand each to its own thread; a
    // handle is used by one thread at a time.
    static std::vector<LocalBackend> create_group(int size, LocalGroupOptions options = {}) {
        if (size < 1) throw Error("gradsync: a LocalBackend group needs at least 1 rank, got " + std::to_string(size));
        check_options(options);
        auto group = std::make_shared<detail::LocalGroup>(size, options);
        std::vector<LocalBackend> ranks;
        ranks.reserve(static_cast<std::size_t>(size));
        for (int r = 0; r < size; ++r) ranks.push_back(LocalBackend(group, r));
        return ranks;
    }

    // Groups within a job of colours.size() ranks (a data-parallel dimension of a larger job):
    // job rank r joins the group of every rank of colour colours[r], numbered there in job rank
    // order. Element r is job rank r's handle in its group; hand it to that rank's thread beside
    // its other handles. `name(colour)`, when given, names each group in messages, which also
    // list its job ranks.
    static std::vector<LocalBackend> split(std::span<const int> colours, LocalGroupOptions options = {},
                                           const std::function<std::string(int)>& name = {}) {
        if (colours.empty()) throw Error("gradsync: LocalBackend::split needs the colour of at least 1 rank");
        check_options(options);
        std::map<int, std::vector<int>> members;  // colour -> job ranks, ascending
        for (std::size_t r = 0; r < colours.size(); ++r) members[colours[r]].push_back(static_cast<int>(r));
        std::vector<std::optional<LocalBackend>> handles(colours.size());
        for (auto& [colour, job_ranks] : members) {
            const int size = static_cast<int>(job_ranks.size());
            auto label = group_label(name ? name(colour) : std::string(), job_ranks, static_cast<int>(colours.size()));
            auto group = std::make_shared<detail::LocalGroup>(size, options, std::move(label));
            for (int r = 0; r < size; ++r)
                handles[static_cast<std::size_t>(job_ranks[static_cast<std::size_t>(r)])].emplace(
                    LocalBackend(group, r));
        }
        std::vector<LocalBackend> ranks;
        ranks.reserve(colours.size());
        for (auto& h : handles) ranks.push_back(std::move(*h));
        return ranks;
    }

    LocalBackend(LocalBackend&&) noexcept = default;
    LocalBackend& operator=(LocalBackend&& other) noexcept {
        if (this != &other) {
            leave();
            group_ = std::move(other.group_);
            rank_ = other.rank_;
            next_seq_ = other.next_seq_;
            async_ = std::move(other.async_);
        }
        return *this;
    }
    LocalBackend(const LocalBackend&) = delete;
    LocalBackend& operator=(const LocalBackend&) = delete;
    // Finishes the rank's pending collectives, then leaves the group: peers still waiting for this
    // rank fail at once instead of at their deadline.
    ~LocalBackend() { leave(); }

    [[nodiscard]] int rank() const { return rank_; }
    [[nodiscard]] int size() const { return group_->size(); }
    // float32, float64, and float16 and bfloat16 (summed in float).
    [[nodiscard]] bool supports(DType t) const { return detail::reducible(t); }
    [[nodiscard]] const LocalGroupOptions& options() const { return group_->options(); }
    // Which ranks of the job this group holds (the whole job's for create_group).
    [[nodiscard]] const GroupLabel& group() const { return group_->label(); }
    // Staging and scratch memory this rank's collectives use.
    [[nodiscard]] Bytes memory_footprint() const { return group_->memory_per_rank(); }
    // How many collectives this rank has called so far (the next one is number calls_made() + 1).
    [[nodiscard]] std::uint64_t calls_made() const { return next_seq_; }

    // In-place allreduce of a contiguous buffer. The tag, when given, must match on every rank.
    void allreduce(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        run_now(allreduce_call(buf, op, tag));
    }
    CollectiveHandle allreduce_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        return launch(allreduce_call(buf, op, tag));
    }

    // In-place allreduce of the concatenation of `segments`: gradients reduced where they lie.
    // The segment list must stay valid until the collective completes.
    void allreduce(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum,
                   CollectiveTag tag = {}) {
        run_now(scattered_call(segments, dtype, op, tag));
    }
    CollectiveHandle allreduce_async(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum,
                                     CollectiveTag tag = {}) {
        return launch(scattered_call(segments, dtype, op, tag));
    }

    // Leaves the reduction over the ranks in this rank's shard of `buf` (shard_of(buf.count, size(),
    // rank())), bitwise the allreduce's there; the rest of `buf` is left as it was.
    void reduce_scatter(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        run_now(sharded_call(CollectiveKind::reduce_scatter, buf, op, tag));
    }
    CollectiveHandle reduce_scatter_async(Buffer buf, ReduceOp op = ReduceOp::sum, CollectiveTag tag = {}) {
        return launch(sharded_call(CollectiveKind::reduce_scatter, buf, op, tag));
    }

    // The same over the concatenation of `segments` (which must stay valid until completion):
    // sharded gradients and parameters where they lie.
    void reduce_scatter(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum,
                        CollectiveTag tag = {}) {
        run_now(scattered_call(segments, dtype, op, tag, CollectiveKind::reduce_scatter));
    }
    CollectiveHandle reduce_scatter_async(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum,
                                          CollectiveTag tag = {}) {
        return launch(scattered_call(segments, dtype, op, tag, CollectiveKind::reduce_scatter));
    }
    void all_gather(std::span<const Segment> segments, DType dtype, CollectiveTag tag = {}) {
        run_now(scattered_call(segments, dtype, ReduceOp::sum, tag, CollectiveKind::all_gather));
    }
    CollectiveHandle all_gather_async(std::span<const Segment> segments, DType dtype, CollectiveTag tag = {}) {
        return launch(scattered_call(segments, dtype, ReduceOp::sum, tag, CollectiveKind::all_gather));
    }

    // Copies every rank's shard of its `buf` into the same place of every other rank's.
    void all_gather(Buffer buf, CollectiveTag tag = {}) {
        run_now(sharded_call(CollectiveKind::all_gather, buf, ReduceOp::sum, tag));
    }
    CollectiveHandle all_gather_async(Buffer buf, CollectiveTag tag = {}) {
        return launch(sharded_call(CollectiveKind::all_gather, buf, ReduceOp::sum, tag));
    }

    // Copies `root`'s bytes into every other rank's buffer of the same size.
    void broadcast(std::span<std::byte> bytes, int root, CollectiveTag tag = {}) {
        run_now(broadcast_call(bytes, root, tag));
    }
    CollectiveHandle broadcast_async(std::span<std::byte> bytes, int root, CollectiveTag tag = {}) {
        return launch(broadcast_call(bytes, root, tag));
    }

    void barrier() {
        detail::LocalCall call;
        call.kind = CollectiveKind::barrier;
        call.seq = ++next_seq_;
        run_now(call);
    }

    // Fails every pending and future collective of every rank of the group, with `reason`.
    void abort(const std::string& reason) { group_->abort(reason); }
    // Throws the abort's reason once the group was aborted (HealthPolling): a step whose
    // collectives all completed before a peer failed it fails too.
    void throw_if_failed() const { group_->throw_if_aborted(rank_); }

    // `reporter` says where this rank stands; a peer that times out waiting for this rank quotes
    // it. It runs on the peer's thread, so it may only read what is safe to read from there.
    std::uint64_t add_status_reporter(std::function<std::string()> reporter) {
        return group_->add_status_reporter(rank_, std::move(reporter));
    }
    void remove_status_reporter(std::uint64_t id) { group_->remove_status_reporter(rank_, id); }
    [[nodiscard]] std::string peer_status(int rank) const { return group_->status_of(rank); }
    [[nodiscard]] std::uint64_t peer_collectives(int rank) const { return group_->collectives_entered(rank); }

private:
    static void check_options(const LocalGroupOptions& options) {
        if (options.timeout.count() <= 0)
            throw Error("gradsync: LocalGroupOptions::timeout must be positive, got " +
                        std::to_string(options.timeout.count()) + " ms");
    }

    LocalBackend(std::shared_ptr<detail::LocalGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}

    detail::LocalCall allreduce_call(Buffer buf, ReduceOp op, CollectiveTag tag) {
        detail::LocalCall call;
        call.kind = CollectiveKind::allreduce;
        call.dtype = buf.dtype;
        call.op = op;
        call.count = buf.count;
        call.single = Segment{buf.data, buf.count};
        call.tag = tag;
        call.seq = ++next_seq_;
        return call;
    }
    detail::LocalCall scattered_call(std::span<const Segment> segments, DType dtype, ReduceOp op, CollectiveTag tag,
                                     CollectiveKind kind = CollectiveKind::allreduce) {
        detail::LocalCall call;
        call.kind = kind;
        call.dtype = dtype;
        call.op = op;
        call.count = detail::total_count(segments);
        call.segments = segments.data();
        call.segment_count = segments.size();
        call.tag = tag;
        call.seq = ++next_seq_;
        return call;
    }
    detail::LocalCall sharded_call(CollectiveKind kind, Buffer buf, ReduceOp op, CollectiveTag tag) {
        detail::LocalCall call = allreduce_call(buf, op, tag);
        call.kind = kind;
        return call;
    }
    detail::LocalCall broadcast_call(std::span<std::byte> bytes, int root, CollectiveTag tag) {
        detail::LocalCall call;
        call.kind = CollectiveKind::broadcast;
        call.root = root;
        call.count = bytes.size();
        call.single = Segment{bytes.data(), bytes.size()};
        call.tag = tag;
        call.seq = ++next_seq_;
        return call;
    }

    // Runs the call on this thread. A failure here is the group's failure: it is aborted, so that
    // peers do not wait for this rank.
    static void execute(detail::LocalGroup& group, int rank, const detail::LocalCall& call) {
        try {
            group.execute(rank, call);
        } catch (const std::exception& e) {
            group.abort(e.what());
            throw;
        }
    }

    // Synchronous calls run on the caller's thread, after the rank's pending asynchronous ones.
    void run_now(const detail::LocalCall& call) {
        async_.wait_for_all();
        execute(*group_, rank_, call);
    }

    CollectiveHandle launch(const detail::LocalCall& call) {
        auto done = std::make_shared<detail::Completion>(waiting_);
        async_.launch([group = group_, rank = rank_, call] { execute(*group, rank, call); }, done);
        return CollectiveHandle(std::move(done));
    }

    void leave() {
        if (!group_) return;
        async_.stop();  // drains the queue: every task ends by its deadline
        group_->depart(rank_);
        group_.reset();
    }

    std::shared_ptr<detail::LocalGroup> group_;
    int rank_ = 0;
    std::uint64_t next_seq_ = 0;
    detail::AsyncCollectives async_;
    std::shared_ptr<detail::SpinBudget> waiting_ = std::make_shared<detail::SpinBudget>();  // for handles
};

}  // namespace gradsync::inline v0
