// Handles to asynchronous collectives: what a backend's allreduce_async returns (the Waitable
// concept), and the completion state the host backends share between the thread that runs a
// collective and the ones that wait for it.
#pragma once

#include <gradsync/detail/wait.hpp>

#include <atomic>
#include <chrono>
#include <concepts>   // for std::convertible_to
#include <exception>  // for std::exception_ptr
#include <memory>     // for std::shared_ptr
#include <utility>    // for std::move

namespace gradsync::inline v0 {

namespace detail {

// Shared state of one asynchronous operation: set once by the thread that runs it.
struct Completion {
    // Waiters share the budget of their backend, which learns how long spinning pays.
    explicit Completion(std::shared_ptr<SpinBudget> waiting) : spin(std::move(waiting)) {}

    std::shared_ptr<SpinBudget> spin;
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
                               bell, *spin);
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

// What every backend's asynchronous collectives return.
template <class H>
concept Waitable = requires(const H& h, std::chrono::steady_clock::time_point deadline) {
    h.wait();
    { h.ready() } -> std::convertible_to<bool>;
    { h.wait_until(deadline) } -> std::convertible_to<bool>;
};

namespace detail {

// When a completed collective finished, where its handle can tell (`finished_at()`, for timelines
// and bucket tuning); none otherwise, and the collective is then shown as untimed.
template <Waitable H>
std::chrono::steady_clock::time_point finished_at(const H& handle) {
    if constexpr (requires { handle.finished_at(); })
        return handle.finished_at();
    else
        return {};
}

}  // namespace detail

}  // namespace gradsync::inline v0
