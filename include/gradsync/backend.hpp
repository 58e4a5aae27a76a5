// What a communication backend provides (the Backend concept) and the vocabulary its collectives
// speak: buffers with a run-time dtype, reduction operators, and handles to wait on.
#pragma once

#include <gradsync/bytes.hpp>
#include <gradsync/detail/meta.hpp>
#include <gradsync/detail/wait.hpp>
#include <gradsync/dtype.hpp>

#include <atomic>
#include <chrono>
#include <concepts>  // for std::convertible_to
#include <cstddef>
#include <cstdint>
#include <exception>   // for std::exception_ptr
#include <functional>  // for std::function
#include <memory>      // for std::shared_ptr
#include <span>
#include <string>

namespace gradsync::inline v0 {

enum class ReduceOp : std::uint8_t {
    sum,
    average,  // sum divided by the number of ranks
};

inline std::string to_string(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "average"; }

// `count` elements at `data`; the dtype travels beside it.
struct Segment {
    void* data = nullptr;
    std::size_t count = 0;
};

// A contiguous buffer of `count` elements of `dtype`.
struct Buffer {
    void* data = nullptr;
    std::size_t count = 0;
    DType dtype = DType::float32;
};

template <HasDType T>
Buffer buffer_of(std::span<T> s) {
    return Buffer{s.data(), s.size(), dtype_of<T>};
}

// What a collective is for, so that a mismatch across ranks is named in terms the user knows.
// `fingerprint` folds every collective the caller issued so far: equal fingerprints mean equal
// histories, so a divergence is caught even where the current calls happen to look alike.
struct CollectiveTag {
    std::uint64_t fingerprint = 0;
    std::int64_t step = -1;    // -1: not a training step's collective
    std::int32_t bucket = -1;  // -1: not a bucket's collective

    friend bool operator==(const CollectiveTag&, const CollectiveTag&) = default;
};

namespace detail {

// The dtypes the host backends reduce: the floating ones (16-bit accumulated in float).
inline bool reducible(DType t) {
    return t == DType::float32 || t == DType::float64 || t == DType::float16 || t == DType::bfloat16;
}

inline std::size_t total_count(std::span<const Segment> segs) {
    std::size_t n = 0;
    for (const auto& s : segs) n += s.count;
    return n;
}

// Shared state of one asynchronous operation: set once by the thread that runs it.
struct Completion {
    // Waiters spin only where the thread doing the work is sure to have a core of its own.
    explicit Completion(SpinPolicy waiting = {}) : spin(waiting) {}

    SpinPolicy spin;
    std::atomic<bool> done{false};
    std::exception_ptr error;                           // written before `done`, read after it
    std::chrono::steady_clock::time_point finished_at;  // likewise
    Doorbell bell;

    void finish(std::exception_ptr e = nullptr) {
        error = std::move(e);
        finished_at = std::chrono::steady_clock::now();
        done.store(true, std::memory_order_seq_cst);
        bell.ring();
    }
    // True when done by `deadline`.
    bool wait_until(std::chrono::steady_clock::time_point deadline) {
        struct Expired {};
        try {
            detail::wait_until([this] { return done.load(std::memory_order_acquire); },
                               [deadline] {
                                   if (std::chrono::steady_clock::now() >= deadline) throw Expired{};
                               },
                               bell, spin);
        } catch (Expired) {
            return done.load(std::memory_order_acquire);
        }
        return true;
    }
};

}  // namespace detail

// Handle to an asynchronous collective. wait() returns when it has completed and rethrows its
// error, if any; every collective ends by its backend's deadline, so wait() cannot hang forever.
// wait_until() also gives up at a deadline of the caller's. The buffers the collective works on
// must stay valid, and untouched by the caller, until it has completed.
class CollectiveHandle {
public:
    CollectiveHandle() = default;  // an already completed no-op
    explicit CollectiveHandle(std::shared_ptr<detail::Completion> state) : state_(std::move(state)) {}

    [[nodiscard]] bool ready() const { return !state_ || state_->done.load(std::memory_order_acquire); }

    void wait() const { (void)wait_until(std::chrono::steady_clock::time_point::max()); }

    // False when the deadline passed first; otherwise rethrows the collective's error, if any.
    [[nodiscard]] bool wait_until(std::chrono::steady_clock::time_point deadline) const {
        if (!state_) return true;
        if (!state_->wait_until(deadline)) return false;
        if (state_->error) std::rethrow_exception(state_->error);
        return true;
    }

    // When the collective completed (for timelines); only meaningful once ready().
    [[nodiscard]] std::chrono::steady_clock::time_point finished_at() const {
        return state_ ? state_->finished_at : std::chrono::steady_clock::time_point{};
    }

private:
    std::shared_ptr<detail::Completion> state_;
};

template <class H>
concept Waitable = requires(const H& h, std::chrono::steady_clock::time_point deadline) {
    h.wait();
    { h.ready() } -> std::convertible_to<bool>;
    { h.wait_until(deadline) } -> std::convertible_to<bool>;
};

// A backend runs collectives among the ranks of one group. Every rank calls the same collectives
// in the same order; a backend reports a mismatch as an exception rather than hanging.
template <class B>
concept Backend = requires(B& b, const B& cb, Buffer buf, ReduceOp op, std::span<std::byte> bytes, int root, DType t) {
    { cb.rank() } -> std::convertible_to<int>;
    { cb.size() } -> std::convertible_to<int>;
    { cb.supports(t) } -> std::convertible_to<bool>;
    b.allreduce(buf, op);
    { b.allreduce_async(buf, op) } -> Waitable;
    b.broadcast(bytes, root);
    b.barrier();
};

// A backend that reduces gradients where they lie, over a list of segments, so DataParallel
// needs no bucket buffer and no pack or unpack copy (LocalBackend, in shared memory).
template <class B>
concept ScatteredAllreduce = Backend<B> && requires(B& b, std::span<const Segment> segs, DType t, ReduceOp op) {
    b.allreduce(segs, t, op);
    { b.allreduce_async(segs, t, op) } -> Waitable;
};

// Optional capabilities DataParallel uses when a backend has them.

// Collectives that carry a CollectiveTag (to name them in errors, and to check them).
template <class B>
concept TaggedCollectives = Backend<B> &&
    requires(B& b, Buffer buf, std::span<const Segment> segs, DType t, ReduceOp op, CollectiveTag tag) {
    { b.allreduce_async(buf, op, tag) } -> Waitable;
};

// ...and checked against the other ranks' tags at every call (`static constexpr bool
// checks_tags = true`), so that DataParallel needs no per-step history check of its own.
template <class B>
concept CheckedCollectives = TaggedCollectives<B> && requires {
    requires B::checks_tags;
};

// A backend whose collectives take device memory (`static constexpr bool device_memory = true`,
// NcclBackend): DataParallel's gradients must then lie on the device.
template <class B>
concept DeviceBackend = Backend<B> && requires {
    requires B::device_memory;
};

// abort(reason): every pending and future collective of every rank fails with `reason`, so that
// a failure on one rank reaches the others at once rather than at their deadline.
template <class B>
concept Abortable = Backend<B> && requires(B& b, const std::string& reason) {
    b.abort(reason);
};

// Each rank can leave reporters that say where it stands; the backend quotes them when one of
// this rank's collectives misses its deadline (MpiBackend).
template <class B>
concept StatusReporting = Backend<B> && requires(B& b, std::function<std::string()> reporter, std::uint64_t id) {
    { b.add_status_reporter(reporter) } -> std::convertible_to<std::uint64_t>;
    b.remove_status_reporter(id);
};

// ...and peers can call them, without a collective, when they need to say why this rank is late
// (LocalBackend: shared memory).
template <class B>
concept PeerStatus = StatusReporting<B> && requires(const B& cb, int rank) {
    { cb.peer_status(rank) } -> std::convertible_to<std::string>;
    { cb.peer_collectives(rank) } -> std::convertible_to<std::uint64_t>;  // how many it has entered
};

namespace detail {

template <class B>
constexpr bool check_backend() {
    if constexpr (!Backend<B>) {
        static_assert(
            requires(const B& b) {
                { b.rank() } -> std::convertible_to<int>;
            },
            "gradsync: a Backend needs `int rank() const`");
        static_assert(
            requires(const B& b) {
                { b.size() } -> std::convertible_to<int>;
            },
            "gradsync: a Backend needs `int size() const`");
        static_assert(
            requires(const B& b, DType t) {
                { b.supports(t) } -> std::convertible_to<bool>;
            },
            "gradsync: a Backend needs `bool supports(gradsync::DType) const`");
        static_assert(
            requires(B & b, Buffer buf, ReduceOp op) { b.allreduce(buf, op); },
            "gradsync: a Backend needs `void allreduce(gradsync::Buffer, gradsync::ReduceOp)`");
        static_assert(
            requires(B & b, Buffer buf, ReduceOp op) {
                { b.allreduce_async(buf, op) } -> Waitable;
            },
            "gradsync: a Backend needs `Handle allreduce_async(gradsync::Buffer, gradsync::ReduceOp)` "
            "returning a handle with `void wait() const`, `bool ready() const` and "
            "`bool wait_until(std::chrono::steady_clock::time_point) const`");
        static_assert(
            requires(B & b, std::span<std::byte> bytes, int root) { b.broadcast(bytes, root); },
            "gradsync: a Backend needs `void broadcast(std::span<std::byte>, int root)`");
        static_assert(
            requires(B & b) { b.barrier(); }, "gradsync: a Backend needs `void barrier()`");
    }
    return Backend<B>;
}

}  // namespace detail

}  // namespace gradsync::inline v0
