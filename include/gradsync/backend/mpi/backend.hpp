// MpiBackend: one rank per process (mpirun, srun, or any MPI-3 launcher), collectives through
// MPI on a communicator of its own.
//
// Threads: synchronous collectives run on the caller's thread, asynchronous ones on a progress
// thread, never two at once, so MPI must give at least MPI_THREAD_SERIALIZED (MpiSession asks for
// MPI_THREAD_MULTIPLE). No silent hangs: a watcher thread ends the job when a collective has not
// completed by the deadline, after printing which rank waited in which collective. MPI cannot
// cancel a collective, so a stuck one cannot be turned into an exception the process survives.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/detail/async_collectives.hpp>
#include <gradsync/backend/detail/watcher_thread.hpp>
#include <gradsync/backend/mpi/arithmetic.hpp>
#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/backend/mpi/session.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

#include <algorithm>  // for std::min, std::max
#include <chrono>
#include <climits>  // for INT_MAX
#include <cstddef>
#include <cstdio>      // for std::fprintf
#include <cstdlib>     // for std::_Exit
#include <cstring>     // for std::memcpy
#include <functional>  // for std::function
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>  // for std::is_trivially_copyable_v
#include <utility>      // for std::move
#include <vector>

namespace gradsync::inline v0 {

// How MpiBackend reduces.
enum class MpiAlgorithm : std::uint8_t {
    // ring for pieces of MpiOptions::ring_min and more, the MPI library's own allreduce below.
    automatic,
    // MPI_Allreduce in place, then a pass that divides by the number of ranks for an average.
    mpi_allreduce,
    // Our ring over point-to-point messages: reduce-scatter then all-gather, in place, with the
    // division for an average folded into the last reduction step, so the gradients are read and
    // written no more often than the reduction itself needs, and the only scratch memory is
    // persistent (one huge MPI_Allreduce page-faults on fresh temporaries at every call).
    ring,
};

struct MpiOptions {
    MpiAlgorithm algorithm = MpiAlgorithm::automatic;
    // A collective that has not completed by then ends the job (MPI_Abort) with a diagnosis.
    std::chrono::milliseconds timeout = std::chrono::seconds(600);
    // An allreduce runs in pieces of this size, so each piece is still in cache when it is
    // averaged, and scratch memory stays at this size over the number of ranks.
    Bytes chunk = Bytes{4u << 20};
    // `automatic` uses the ring for pieces of at least this size.
    Bytes ring_min = Bytes{256u << 10};
    // Segments smaller than this are packed together and reduced in one call: many small
    // tensors must not mean many collectives.
    Bytes pack_below = Bytes{64u << 10};
};

// Collectives of one MPI communicator (a duplicate of the one given, so that ours never match the
// program's own messages). Driven by one thread at a time, like every backend: DataParallel does.
// Construct and destroy it between MPI initialisation and finalisation (MpiSession does both).
class MpiBackend {
public:
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
        check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
        MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);  // errors become exceptions, not exits
        MPI_Comm_rank(comm_, &rank_);
        MPI_Comm_size(comm_, &size_);
        MPI_Type_contiguous(2, MPI_BYTE, &half_type_);
        MPI_Type_commit(&half_type_);
        MPI_Op_create(&detail::mpi_sum_16<float16>, /*commute=*/1, &sum_f16_);
        MPI_Op_create(&detail::mpi_sum_16<bfloat16>, /*commute=*/1, &sum_bf16_);
        // Wakes at the running collective's deadline, or one timeout from now when none runs: a
        // collective that starts meanwhile has a later deadline, so nothing on the collectives'
        // path ever needs to wake the watcher.
        watcher_.emplace(
            [this] {
                std::lock_guard lock(watch_mutex_);
                return busy_ ? deadline_ : std::chrono::steady_clock::now() + options_.timeout;
            },
            [this] { end_if_late(); });
    }
    MpiBackend(const MpiBackend&) = delete;
    MpiBackend& operator=(const MpiBackend&) = delete;
    ~MpiBackend() {
        async_.stop();  // drains: every queued collective ends, or the watcher ends the job
        watcher_.reset();
        MPI_Op_free(&sum_f16_);
        MPI_Op_free(&sum_bf16_);
        MPI_Type_free(&half_type_);
        MPI_Comm_free(&comm_);
    }

    [[nodiscard]] int rank() const { return rank_; }
    [[nodiscard]] int size() const { return size_; }
    [[nodiscard]] bool supports(DType t) const { return detail::reducible(t); }
    // The communicator the collectives run on (our duplicate), e.g. to bootstrap another library.
    [[nodiscard]] MPI_Comm communicator() const { return comm_; }
    [[nodiscard]] const MpiOptions& options() const { return options_; }

    void allreduce(Buffer buf, ReduceOp op) {
        const Segment seg{buf.data, buf.count};
        allreduce(std::span<const Segment>(&seg, 1), buf.dtype, op);
    }
    template <HasDType T>
    void allreduce(std::span<T> data, ReduceOp op) {
        allreduce(buffer_of(data), op);
    }
    CollectiveHandle allreduce_async(Buffer buf, ReduceOp op) {
        return launch(describe_allreduce(buf.count, buf.dtype, op), [this, buf, op] {
            const Segment seg{buf.data, buf.count};
            reduce_segments(std::span<const Segment>(&seg, 1), buf.dtype, op);
        });
    }

    // Reduces the segments where they lie: large ones in place, in chunks; small ones packed
    // together first. Every rank must pass segments of the same sizes in the same order.
    void allreduce(std::span<const Segment> segments, DType dtype, ReduceOp op) {
        check_dtype(dtype);
        run_now(describe_allreduce(detail::total_count(segments), dtype, op),
                [&] { reduce_segments(segments, dtype, op); });
    }
    // The segment list is copied; the memory it points to must stay untouched until completion.
    CollectiveHandle allreduce_async(std::span<const Segment> segments, DType dtype, ReduceOp op) {
        check_dtype(dtype);
        std::vector<Segment> copy(segments.begin(), segments.end());
        return launch(describe_allreduce(detail::total_count(segments), dtype, op),
                      [this, copy = std::move(copy), dtype, op] { reduce_segments(copy, dtype, op); });
    }

    void broadcast(std::span<std::byte> bytes, int root) {
        if (root < 0 || root >= size_)
            throw CollectiveError(detail::rank_prefix(rank_) + ": broadcast from rank " + std::to_string(root) +
                                  " of a group of " + std::to_string(size_));
        const std::string what =
            CollectiveCall{.kind = CollectiveKind::broadcast, .seq = ++seq_, .count = bytes.size(), .root = root}
                .describe();
        run_now(what, [&] {
            for (std::size_t off = 0; off < bytes.size(); off += INT_MAX) {
                const int n = static_cast<int>(std::min<std::size_t>(INT_MAX, bytes.size() - off));
                check(MPI_Bcast(bytes.data() + off, n, MPI_BYTE, root, comm_), "MPI_Bcast");
            }
        });
    }
    template <class T>
    requires std::is_trivially_copyable_v<T>
    void broadcast(std::span<T> data, int root) { broadcast(std::as_writable_bytes(data), root); }

    void barrier() {
        run_now(CollectiveCall{.kind = CollectiveKind::barrier, .seq = ++seq_}.describe(),
                [&] { check(MPI_Barrier(comm_), "MPI_Barrier"); });
    }

    // `reporter` says where this rank stands (DataParallel: step, bucket, missing gradients); the
    // watcher quotes it when a collective misses its deadline. It runs on the watcher's thread.
    std::uint64_t add_status_reporter(std::function<std::string()> reporter) {
        std::lock_guard lock(reporters_mutex_);
        reporters_.emplace_back(++next_reporter_, std::move(reporter));
        return next_reporter_;
    }
    void remove_status_reporter(std::uint64_t id) {
        std::lock_guard lock(reporters_mutex_);
        std::erase_if(reporters_, [id](const auto& r) { return r.first == id; });
    }

    // Ends the whole job: prints `reason` with this rank's number, then MPI_Abort. Peers blocked
    // in collectives cannot be released any other way.
    [[noreturn]] void abort(const std::string& reason) {
        std::fprintf(stderr, "gradsync: rank %d aborts the job: %s\n", rank_, reason.c_str());
        std::fflush(stderr);
        end_job();
    }

private:
    void check(int rc, const char* call) const {
        if (rc != MPI_SUCCESS)
            throw CollectiveError(detail::rank_prefix(rank_) + ": " + call +
                                  " failed: " + detail::mpi_error_string(rc));
    }

    void check_dtype(DType t) const {
        if (!supports(t))
            throw CollectiveError(detail::rank_prefix(rank_) + ": MpiBackend cannot reduce " + to_string(t));
    }

    std::string describe_allreduce(std::size_t count, DType t, ReduceOp op) {
        return CollectiveCall{.kind = CollectiveKind::allreduce, .seq = ++seq_, .count = count, .dtype = t, .op = op}
            .describe();
    }

    [[nodiscard]] MPI_Datatype mpi_type(DType t) const {
        switch (t) {
            case DType::float64: return MPI_DOUBLE;
            case DType::float16:
            case DType::bfloat16: return half_type_;
            default: return MPI_FLOAT;
        }
    }
    [[nodiscard]] MPI_Op mpi_sum(DType t) const {
        if (t == DType::float16) return sum_f16_;
        if (t == DType::bfloat16) return sum_bf16_;
        return MPI_SUM;
    }

    // In place, `count` elements at `data`, in pieces of options_.chunk.
    void reduce_run(std::byte* data, std::size_t count, DType t, ReduceOp op) {
        const std::size_t elem = size_of(t);
        const std::size_t chunk =
            std::max<std::size_t>(1, std::min<std::size_t>(options_.chunk.count(), std::size_t{1} << 30) / elem);
        for (std::size_t off = 0; off < count; off += chunk) {
            const std::size_t k = std::min(chunk, count - off);
            std::byte* p = data + off * elem;
            const bool ring = options_.algorithm == MpiAlgorithm::ring ||
                              (options_.algorithm == MpiAlgorithm::automatic && k * elem >= options_.ring_min.count());
            if (ring && k >= std::size_t(size_)) {
                ring_allreduce(p, k, t, op);
            } else {
                check(MPI_Allreduce(MPI_IN_PLACE, p, static_cast<int>(k), mpi_type(t), mpi_sum(t), comm_),
                      "MPI_Allreduce");
                if (op == ReduceOp::average) average(p, k, t);
            }
        }
    }

    // Ring allreduce of `count` elements at `data`, in place. Part i of the n parts is summed
    // along the ring ending at rank i - 1 (mod n), which averages it in the same pass, and is then
    // passed around: every rank ends with the same bits.
    void ring_allreduce(std::byte* data, std::size_t count, DType t, ReduceOp op) {
        const int n = size_;
        const std::size_t elem = size_of(t);
        auto begin = [&](int part) { return count * std::size_t(part) / std::size_t(n); };
        auto length = [&](int part) { return begin(part + 1) - begin(part); };
        const std::size_t most = (count + std::size_t(n) - 1) / std::size_t(n);
        if (scratch_.size() < most * elem) scratch_.resize(most * elem);
        const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
        constexpr int tag = 0x6773;  // on our own communicator: no other messages to confuse it with
        for (int step = 0; step + 1 < n; ++step) {
            const int send = (rank_ - step + 2 * n) % n, recv = (rank_ - step - 1 + 2 * n) % n;
            check(MPI_Sendrecv(data + begin(send) * elem, static_cast<int>(length(send) * elem), MPI_BYTE, right, tag,
                               scratch_.data(), static_cast<int>(length(recv) * elem), MPI_BYTE, left, tag, comm_,
                               MPI_STATUS_IGNORE),
                  "MPI_Sendrecv");
            const bool last = step + 2 == n;
            detail::add_received(data + begin(recv) * elem, scratch_.data(), length(recv), t,
                                 last && op == ReduceOp::average ? 1.0 / n : 1.0);
        }
        for (int step = 0; step + 1 < n; ++step) {
            const int send = (rank_ + 1 - step + 2 * n) % n, recv = (rank_ - step + 2 * n) % n;
            check(MPI_Sendrecv(data + begin(send) * elem, static_cast<int>(length(send) * elem), MPI_BYTE, right, tag,
                               data + begin(recv) * elem, static_cast<int>(length(recv) * elem), MPI_BYTE, left, tag,
                               comm_, MPI_STATUS_IGNORE),
                  "MPI_Sendrecv");
        }
    }

    void average(std::byte* p, std::size_t k, DType t) const { detail::average_elements(p, k, t, size_); }

    void reduce_segments(std::span<const Segment> segments, DType t, ReduceOp op) {
        if (size_ == 1) return;  // the sum and the average of one rank are its own values
        const std::size_t elem = size_of(t);
        const std::size_t small = options_.pack_below.count() / elem;
        std::size_t packed = 0;  // elements in staging_
        std::size_t first_small = 0;
        // Packs small segments [first_small, end) into staging_, reduces, and copies them back.
        auto flush = [&](std::size_t end) {
            if (packed == 0) return;
            reduce_run(staging_.data(), packed, t, op);
            std::size_t at = 0;
            for (std::size_t i = first_small; i < end; ++i) {
                const auto& s = segments[i];
                if (s.count >= small || s.count == 0) continue;
                std::memcpy(s.data, staging_.data() + at * elem, s.count * elem);
                at += s.count;
            }
            packed = 0;
        };
        for (std::size_t i = 0; i < segments.size(); ++i) {
            const auto& s = segments[i];
            if (s.count == 0) continue;
            if (s.count >= small) {
                reduce_run(static_cast<std::byte*>(s.data), s.count, t, op);
                continue;
            }
            if (packed == 0) first_small = i;
            if (staging_.size() < (packed + s.count) * elem)
                staging_.resize(std::max(options_.pack_below.count() * 4, (packed + s.count) * elem * 2));
            std::memcpy(staging_.data() + packed * elem, s.data, s.count * elem);
            packed += s.count;
            if (packed * elem >= options_.chunk.count()) flush(i + 1);
        }
        flush(segments.size());
    }

    // Runs a collective on this thread, after every asynchronous one launched before it.
    template <class F>
    void run_now(const std::string& what, F&& body) {
        async_.wait_for_all();
        guarded(what, body);
    }

    template <class F>
    CollectiveHandle launch(std::string what, F body) {
        auto done = std::make_shared<detail::Completion>();
        async_.launch([this, what = std::move(what), body = std::move(body)]() mutable { guarded(what, body); }, done);
        return CollectiveHandle(std::move(done));
    }

    // Runs one collective under the watcher's eye.
    template <class F>
    void guarded(const std::string& what, F& body) {
        {
            std::lock_guard lock(watch_mutex_);
            current_ = what;
            deadline_ = std::chrono::steady_clock::now() + options_.timeout;
            busy_ = true;
        }
        struct Done {
            MpiBackend* self;
            ~Done() {
                std::lock_guard lock(self->watch_mutex_);
                self->busy_ = false;
            }
        } done{this};
        body();
    }

    // On the watcher's thread: the running collective is past its deadline, so the job ends.
    void end_if_late() {
        std::string what;
        {
            std::lock_guard lock(watch_mutex_);
            if (!busy_ || std::chrono::steady_clock::now() < deadline_) return;
            what = current_;
        }
        report_timeout(what);
        end_job();
    }

    void report_timeout(const std::string& what) {
        std::string where;
        {
            std::lock_guard reporters_lock(reporters_mutex_);
            for (const auto& r : reporters_) where += "; this rank is " + r.second();
        }
        const auto seconds = std::chrono::duration<double>(options_.timeout).count();
        std::fprintf(stderr,
                     "gradsync: rank %d of %d: %s has not completed after %.3g s (MpiOptions::timeout)%s. A peer rank "
                     "is late, has exited, or called a different collective; MPI cannot cancel a collective, so this "
                     "rank ends the job.\n",
                     rank_, size_, what.c_str(), seconds, where.c_str());
        std::fflush(stderr);
    }

    [[noreturn]] void end_job() {
        // MPI_Abort while another thread may be inside MPI is only allowed at MPI_THREAD_MULTIPLE;
        // below it, exiting without MPI_Finalize makes the launcher end the job just the same.
        if (level_ == MPI_THREAD_MULTIPLE) MPI_Abort(comm_, 1);
        std::_Exit(1);
    }

    MpiOptions options_;
    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0;
    int size_ = 1;
    int level_ = MPI_THREAD_SINGLE;
    MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
    MPI_Op sum_f16_ = MPI_OP_NULL;
    MPI_Op sum_bf16_ = MPI_OP_NULL;
    std::uint64_t seq_ = 0;
    std::vector<std::byte> staging_;  // small segments packed together; used by one collective at a time
    std::vector<std::byte> scratch_;  // the ring's received part; likewise

    std::mutex watch_mutex_;  // the running collective, for the watcher
    std::string current_;
    std::chrono::steady_clock::time_point deadline_;
    bool busy_ = false;
    std::optional<detail::WatcherThread> watcher_;

    std::mutex reporters_mutex_;
    std::vector<std::pair<std::uint64_t, std::function<std::string()>>> reporters_;
    std::uint64_t next_reporter_ = 0;

    detail::AsyncCollectives async_;  // last: destroyed first, drained before the rest
};

}  // namespace gradsync::inline v0
