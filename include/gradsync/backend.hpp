// What a communication backend provides (the Backend concept) and the vocabulary its collectives
// speak: buffers with a run-time dtype, reduction operators, and handles to wait on.
#pragma once

#include <gradsync/bytes.hpp>
#include <gradsync/detail/meta.hpp>
#include <gradsync/detail/wait.hpp>
#include <gradsync/dtype.hpp>

#include <atomic>
#include <concepts>  // for std::convertible_to
#include <cstddef>
#include <cstdint>
#include <exception>  // for std::exception_ptr
#include <memory>     // for std::shared_ptr
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

namespace detail {

// Shared state of one asynchronous operation: set once by the thread that runs it.
struct Completion {
    std::atomic<bool> done{false};
    std::exception_ptr error;  // written before `done`, read after it
    Doorbell bell;

    void finish(std::exception_ptr e = nullptr) {
        error = std::move(e);
        done.store(true, std::memory_order_seq_cst);
        bell.ring();
    }
    void wait() {
        wait_until([this] { return done.load(std::memory_order_acquire); }, [] {}, bell, SpinPolicy{});
    }
};

}  // namespace detail

// Handle to an asynchronous collective. wait() returns when it has completed and rethrows its
// error, if any. Every collective ends by its backend's deadline, so wait() cannot hang forever.
// The buffers it works on must stay valid, and untouched by the caller, until then.
class CollectiveHandle {
public:
    CollectiveHandle() = default;  // an already completed no-op
    explicit CollectiveHandle(std::shared_ptr<detail::Completion> state) : state_(std::move(state)) {}

    [[nodiscard]] bool ready() const { return !state_ || state_->done.load(std::memory_order_acquire); }

    void wait() const {
        if (!state_) return;
        state_->wait();
        if (state_->error) std::rethrow_exception(state_->error);
    }

private:
    std::shared_ptr<detail::Completion> state_;
};

template <class H>
concept Waitable = requires(const H& h) {
    h.wait();
    { h.ready() } -> std::convertible_to<bool>;
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
            "returning a handle with `void wait() const` and `bool ready() const`");
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
