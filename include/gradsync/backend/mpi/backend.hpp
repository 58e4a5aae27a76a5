// MpiBackend: one rank per process (mpirun, srun, or any MPI-3 launcher), collectives through
// MPI on a communicator of its own.
//
// Threads: synchronous collectives run on the caller's thread, asynchronous ones on a progress
// thread, never two at once, so MPI must give at least MPI_THREAD_SERIALIZED (MpiSession asks for
// MPI_THREAD_MULTIPLE). No silent hangs: a watcher thread ends the job when a collective has not
// completed by the deadline, after printing which rank waited in which collective, and at once
// when a rank it needs has left the group (destroyed its backend). MPI cannot cancel a
// collective, so a stuck one cannot be turned into an exception the process survives; one that
// has not started yet can, and does.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/detail/async_collectives.hpp>
#include <gradsync/backend/detail/held_segments.hpp>
#include <gradsync/backend/detail/typed_calls.hpp>
#include <gradsync/backend/detail/watcher_thread.hpp>
#include <gradsync/backend/group_label.hpp>
#include <gradsync/backend/mpi/collective_watch.hpp>
#include <gradsync/backend/mpi/departures.hpp>
#include <gradsync/backend/mpi/groups.hpp>
#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/backend/mpi/options.hpp>
#include <gradsync/backend/mpi/peer_standings.hpp>
#include <gradsync/backend/mpi/reduction.hpp>
#include <gradsync/backend/mpi/session.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/detail/end_process.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::min
#include <chrono>
#include <climits>  // for INT_MAX
#include <cstddef>
#include <cstdio>      // for std::fprintf
#include <exception>   // for std::uncaught_exceptions
#include <functional>  // for std::function
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>  // for std::is_trivially_copyable_v
#include <utility>      // for std::move
#include <vector>

namespace gradsync::inline v0 {

// Collectives of one MPI communicator (a duplicate of the one given, so that ours never match the
// program's own messages). Driven by one thread at a time, like every backend: DataParallel does.
// Construct and destroy it between MPI initialisation and finalisation (MpiSession does both);
// every rank constructs and destroys its backends in the same order (both are collective: the
// destructor waits, up to MpiOptions::timeout, until every peer has destroyed its own).
class MpiBackend : public detail::TypedCalls<MpiBackend> {
public:
    using TypedCalls::all_gather;
    using TypedCalls::all_gather_async;
    using TypedCalls::allreduce;
    using TypedCalls::allreduce_async;
    using TypedCalls::broadcast;
    using TypedCalls::reduce_scatter;
    using TypedCalls::reduce_scatter_async;

    explicit MpiBackend(MPI_Comm comm = mpi_world(), MpiOptions options = {}) : options_(options) {
        int initialized = 0;
        MPI_Initialized(&initialized);
        if (!initialized)
            throw CollectiveError(
                "gradsync: MpiBackend created before MPI was initialised; create a gradsync::MpiSession first (or call "
                "MPI_Init_thread with MPI_THREAD_MULTIPLE)");
        level_ = detail::mpi_thread_level();
        if (level_ < MPI_THREAD_SERIALIZED)
            throw CollectiveError(std::string("gradsync: MPI was initialised with ") +
                                  detail::thread_level_name(level_) +
                                  "; MpiBackend needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (its progress "
                                  "thread calls MPI). Initialise with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
                                  "or gradsync::MpiSession.");
        if (options_.timeout <= std::chrono::milliseconds::zero())
            throw CollectiveError("gradsync: MpiOptions::timeout must be positive");
        if (options_.peer_poll < std::chrono::milliseconds::zero())
            throw CollectiveError("gradsync: MpiOptions::peer_poll must not be negative (zero turns it off)");
        check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
        MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);  // errors become exceptions, not exits
        MPI_Comm_rank(comm_, &rank_);
        MPI_Comm_size(comm_, &size_);
        label_ = detail::mpi_group_label(comm_, options_.group_name);
        reduction_.emplace(comm_, options_, label_.who(rank_));
        departures_.emplace(comm_);
        peers_.emplace(comm_);
        watch_.emplace(label_.who(rank_, size_), options_.timeout);
        // The watcher polls for departed peers and answers peers that ask where this rank stands
        // only where MPI lets a second thread call it.
        polls_ = level_ == MPI_THREAD_MULTIPLE && size_ > 1 && options_.peer_poll.count() > 0;
        watcher_.emplace([this] { return watch_->wake_at(polls_ ? std::optional(options_.peer_poll) : std::nullopt); },
                         [this] {
                             if (polls_) {
                                 end_job_saying(watch_->note_departures(departures_->poll()));
                                 peers_->serve([this] { return watch_->standing().text(); });
                             }
                             auto late = watch_->late();
                             if (late) *late += where_peers_stand();
                             end_job_saying(late);
                         });
    }
    MpiBackend(const MpiBackend&) = delete;
    MpiBackend& operator=(const MpiBackend&) = delete;
    ~MpiBackend() {
        async_.stop();  // drains: every queued collective ends, or the watcher ends the job
        watcher_.reset();
        const auto staying = departures_->leave(watch_->last_completed(), std::uncaught_exceptions() > 0,
                                                detail::deadline_after(options_.timeout));
        if (!staying.empty()) {
            std::string ranks;
            for (const int r : staying) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
            std::fprintf(stderr, "%s: rank(s) %s had not destroyed their MpiBackend %.3g s after this rank did\n",
                         label_.who(rank_).c_str(), ranks.c_str(),
                         std::chrono::duration<double>(options_.timeout).count());
        }
        peers_.reset();
        departures_.reset();
        reduction_.reset();
        MPI_Comm_free(&comm_);
    }

    [[nodiscard]] int rank() const { return rank_; }
    [[nodiscard]] int size() const { return size_; }
    [[nodiscard]] bool supports(DType t) const { return detail::reducible(t); }
    // The communicator the collectives run on (our duplicate), e.g. to bootstrap another library.
    [[nodiscard]] MPI_Comm communicator() const { return comm_; }
    [[nodiscard]] const MpiOptions& options() const { return options_; }
    // Which ranks of the job (mpi_world()) the communicator holds, for messages.
    [[nodiscard]] const GroupLabel& group() const { return label_; }

    void allreduce(Buffer buf, ReduceOp op = ReduceOp::sum) {
        const Segment seg{buf.data, buf.count};
        allreduce(std::span<const Segment>(&seg, 1), buf.dtype, op);
    }
    CollectiveHandle allreduce_async(Buffer buf, ReduceOp op = ReduceOp::sum) {
        check_dtype(buf.dtype);
        return launch(allreduce_call(buf.count, buf.dtype, op), [this, buf, op] {
            const Segment seg{buf.data, buf.count};
            reduction_->reduce(std::span<const Segment>(&seg, 1), buf.dtype, op);
        });
    }

    // Reduces the segments where they lie: large ones in place, in chunks; small ones packed
    // together first. Every rank must pass segments of the same sizes in the same order.
    void allreduce(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum) {
        check_dtype(dtype);
        run_now(allreduce_call(detail::total_count(segments), dtype, op),
                [&] { reduction_->reduce(segments, dtype, op); });
    }
    // The segment list is copied; the memory it points to must stay untouched until completion.
    CollectiveHandle allreduce_async(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum) {
        check_dtype(dtype);
        return launch(
            allreduce_call(detail::total_count(segments), dtype, op),
            [this, held = detail::HeldSegments(segments), dtype, op] { reduction_->reduce(held.get(), dtype, op); });
    }

    // Leaves the reduction over the ranks in this rank's shard of `buf` (shard_of(buf.count,
    // size(), rank())); the rest of `buf` holds partial sums. The first half of our ring.
    void reduce_scatter(Buffer buf, ReduceOp op = ReduceOp::sum) {
        const Segment seg{buf.data, buf.count};
        reduce_scatter(std::span<const Segment>(&seg, 1), buf.dtype, op);
    }
    CollectiveHandle reduce_scatter_async(Buffer buf, ReduceOp op = ReduceOp::sum) {
        const Segment seg{buf.data, buf.count};
        return reduce_scatter_async(std::span<const Segment>(&seg, 1), buf.dtype, op);
    }
    // The same over segments laid end to end (a bucket's gradients where the model keeps them):
    // the shard is of their total, and nothing is packed.
    void reduce_scatter(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum) {
        check_dtype(dtype);
        run_now(sharded_call(CollectiveKind::reduce_scatter, detail::total_count(segments), dtype, op),
                [&] { reduction_->reduce_scatter(segments, dtype, op); });
    }
    CollectiveHandle reduce_scatter_async(std::span<const Segment> segments, DType dtype, ReduceOp op = ReduceOp::sum) {
        check_dtype(dtype);
        return launch(sharded_call(CollectiveKind::reduce_scatter, detail::total_count(segments), dtype, op),
                      [this, held = detail::HeldSegments(segments), dtype, op] {
                          reduction_->reduce_scatter(held.get(), dtype, op);
                      });
    }

    // Copies every rank's shard of its `buf` into the same place of every other rank's (any
    // dtype). The second half of our ring.
    void all_gather(Buffer buf) {
        const Segment seg{buf.data, buf.count};
        all_gather(std::span<const Segment>(&seg, 1), buf.dtype);
    }
    CollectiveHandle all_gather_async(Buffer buf) {
        const Segment seg{buf.data, buf.count};
        return all_gather_async(std::span<const Segment>(&seg, 1), buf.dtype);
    }
    // The same over segments laid end to end: MPI reads and writes them where they lie.
    void all_gather(std::span<const Segment> segments, DType dtype) {
        check_known(dtype);
        run_now(sharded_call(CollectiveKind::all_gather, detail::total_count(segments), dtype, ReduceOp::sum),
                [&] { reduction_->all_gather(segments, size_of(dtype)); });
    }
    CollectiveHandle all_gather_async(std::span<const Segment> segments, DType dtype) {
        check_known(dtype);
        return launch(sharded_call(CollectiveKind::all_gather, detail::total_count(segments), dtype, ReduceOp::sum),
                      [this, held = detail::HeldSegments(segments), dtype] {
                          reduction_->all_gather(held.get(), size_of(dtype));
                      });
    }

    void broadcast(std::span<std::byte> bytes, int root) {
        if (root < 0 || root >= size_)
            throw CollectiveError(label_.who(rank_) + ": broadcast from rank " + std::to_string(root) +
                                  " of a group of " + std::to_string(size_));
        run_now(CollectiveCall{.kind = CollectiveKind::broadcast, .seq = ++seq_, .count = bytes.size(), .root = root},
                [&] {
                    for (std::size_t off = 0; off < bytes.size(); off += INT_MAX) {
                        const int n = static_cast<int>(std::min<std::size_t>(INT_MAX, bytes.size() - off));
                        check(MPI_Bcast(bytes.data() + off, n, MPI_BYTE, root, comm_), "MPI_Bcast");
                    }
                });
    }

    void barrier() {
        run_now(CollectiveCall{.kind = CollectiveKind::barrier, .seq = ++seq_},
                [&] { check(MPI_Barrier(comm_), "MPI_Barrier"); });
    }

    // Where every peer stands, asked now (AsksPeers; for a diagnosis): the collectives each has
    // completed and what its status reporters say, or that it did not answer. Waits up to a
    // second (or half of MpiOptions::timeout); "" where the watcher cannot call MPI (below
    // MPI_THREAD_MULTIPLE, or MpiOptions::peer_poll zero).
    [[nodiscard]] std::string where_peers_stand() const {
        if (!polls_) return {};
        const auto wait = std::min<std::chrono::milliseconds>(std::chrono::seconds(1), options_.timeout / 2);
        const auto words = [this] { return watch_->standing().text(); };
        return detail::where_peers_stand(peers_->ask(wait, words), rank_, watch_->standing(), wait);
    }

    // The peers that have left the group (destroyed their MpiBackend), as far as the watcher has
    // seen: a collective after one has left is refused with a CollectiveError.
    [[nodiscard]] std::vector<int> departed_peers() { return watch_->departed_ranks(); }

    // `reporter` says where this rank stands (DataParallel: step, bucket, missing gradients); the
    // watcher quotes it when a collective misses its deadline. It runs on the watcher's thread.
    std::uint64_t add_status_reporter(std::function<std::string()> reporter) {
        return watch_->add_reporter(std::move(reporter));
    }
    void remove_status_reporter(std::uint64_t id) { watch_->remove_reporter(id); }

    // Ends the whole job: prints `reason` with this rank's number, then MPI_Abort. Peers blocked
    // in collectives cannot be released any other way.
    [[noreturn]] void abort(const std::string& reason) {
        std::fprintf(stderr, "%s aborts the job: %s\n", label_.who(rank_).c_str(), reason.c_str());
        std::fflush(stderr);
        end_job();
    }

private:
    void check(int rc, const char* call) const {
        if (rc != MPI_SUCCESS)
            throw CollectiveError(label_.who(rank_) + ": " + call + " failed: " + detail::mpi_error_string(rc));
    }

    void check_dtype(DType t) const {
        if (!supports(t)) throw CollectiveError(label_.who(rank_) + ": MpiBackend cannot reduce " + to_string(t));
    }

    void check_known(DType t) const {
        if (!is_known(t))
            throw CollectiveError(label_.who(rank_) + ": MpiBackend cannot move dtype " +
                                  std::to_string(static_cast<int>(t)) + ", which is not one gradsync knows");
    }

    CollectiveCall sharded_call(CollectiveKind kind, std::size_t count, DType t, ReduceOp op) {
        return {.kind = kind, .seq = ++seq_, .count = count, .dtype = t, .op = op};
    }

    CollectiveCall allreduce_call(std::size_t count, DType t, ReduceOp op) {
        return {.kind = CollectiveKind::allreduce, .seq = ++seq_, .count = count, .dtype = t, .op = op};
    }

    // Runs a collective on this thread, after every asynchronous one launched before it.
    template <class F>
    void run_now(const CollectiveCall& call, F&& body) {
        async_.wait_for_all();
        guarded(call, body);
    }

    template <class F>
    CollectiveHandle launch(const CollectiveCall& call, F body) {
        auto done = std::make_shared<detail::Completion>(waiting_);
        async_.launch([this, call, body = std::move(body)]() mutable { guarded(call, body); }, done);
        return CollectiveHandle(std::move(done));
    }

    // Runs `call` under the watcher's eye; refuses it when a rank it needs has left.
    template <class F>
    void guarded(const CollectiveCall& call, F& body) {
        watch_->start(call);
        struct Stop {
            detail::CollectiveWatch& watch;
            std::uint64_t seq;
            bool completed = false;
            ~Stop() { watch.stop(seq, completed); }
        } stop{*watch_, call.seq};
        body();
        stop.completed = true;
    }

    // On the watcher's thread: a collective that can never complete, or is past its deadline.
    void end_job_saying(const std::optional<std::string>& why) {
        if (!why) return;
        std::fprintf(stderr, "%s\n", why->c_str());
        std::fflush(stderr);
        end_job();
    }

    // Once per process, whichever thread and backend get here first (detail/end_process.hpp).
    [[noreturn]] void end_job() {
        detail::end_process_once([this] {
            // MPI_Abort while another thread may be inside MPI is only allowed at
            // MPI_THREAD_MULTIPLE; below it, exiting without MPI_Finalize makes the launcher end
            // the job just the same.
            if (level_ == MPI_THREAD_MULTIPLE) MPI_Abort(comm_, 1);
        });
    }

    MpiOptions options_;
    MPI_Comm comm_ = MPI_COMM_NULL;
    GroupLabel label_;
    int rank_ = 0;
    int size_ = 1;
    int level_ = MPI_THREAD_SINGLE;
    std::uint64_t seq_ = 0;  // the number of the last collective launched
    std::optional<detail::MpiReduction> reduction_;
    std::optional<detail::PeerDepartures> departures_;    // polled by the watcher, then left by the destructor
    mutable std::optional<detail::PeerStandings> peers_;  // questions the watcher answers; asked when late
    bool polls_ = false;  // the watcher calls MPI: polls for departures, answers questions

    mutable std::optional<detail::CollectiveWatch> watch_;  // what the watcher watches
    std::optional<detail::WatcherThread> watcher_;

    std::shared_ptr<detail::SpinBudget> waiting_ = std::make_shared<detail::SpinBudget>();  // for handles
    detail::AsyncCollectives async_;  // last: destroyed first, drained before the rest
};

}  // namespace gradsync::inline v0
