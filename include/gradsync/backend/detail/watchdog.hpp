// Watchdog: the asynchronous collectives of one communicator, in issue order, each with its
// deadline, as a device (a CUDA stream under NCCL) runs them. Waiters and a thread of its own
// check them; the first collective found late, or an error the device reports, fails the whole
// communicator once: `abort` runs (so that nothing waits for peers any more) and every waiter,
// now and later, throws the reason. Plain C++: the device is reached through callbacks, which
// the tests fake.
//
// Calls into the communicator go through run(). The abort must never free what such a call is
// using, yet must not wait for a call that polls for minutes: a failure found while a call is
// inside run() only marks the abort as due; the call sees it at its next poll (settle()), ends,
// and the abort runs as it leaves run(). No lock is held while a call polls.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/detail/watcher_thread.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>  // for std::fprintf
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>  // for std::move

namespace gradsync::inline v0::detail {

// One asynchronous collective, as the watchdog sees it.
struct WatchedOp {
    CollectiveCall call;  // what it is, for messages
    std::chrono::steady_clock::time_point deadline;
    void* event = nullptr;                              // the device's completion marker (a cudaEvent_t)
    std::chrono::steady_clock::time_point finished_at;  // written before `done`
    std::atomic<bool> done{false};
    // Someone waits for it: the host (wait_until) or a stream (a device wait). One nobody waits
    // for when its backend goes was abandoned.
    std::atomic<bool> awaited{false};

    [[nodiscard]] std::string describe() const { return call.describe(); }
};

// The ops not yet seen complete, as a backend going away sees them.
struct PendingOps {
    std::size_t count = 0;
    std::size_t abandoned = 0;    // nobody waits for them
    std::string first_abandoned;  // described
    std::chrono::steady_clock::time_point latest_deadline{};
};

// What the watchdog needs from the device. `finished`, `error` and `release` run under the
// watchdog's lock; `abort` runs under it too, and never while a call is inside run().
struct WatchedDevice {
    std::function<bool(void* event)> finished;  // the device completed the op; may throw on a device error
    std::function<std::string()> error;         // empty while the communicator is healthy
    std::function<void()> abort;                // after it, no queued op waits for peers
    std::function<void(void* event)> release;   // the op has retired: its event may be reused
    std::function<void()> enter_thread;         // first thing on the watchdog's own thread (select the GPU)
    std::function<std::string()> peers;         // where the peers it can see stand (" Where ..."), or empty
};

// What a poll of a call still being queued found: in progress (none), done (empty), or failed
// (the device's words).
using QueueState = std::optional<std::string>;

class Watchdog {
public:
    using clock = std::chrono::steady_clock;

    // `who` starts every message ("gradsync: rank 1 of 2 (NCCL, GPU 1)"). The thread that looks
    // at the pending ops every `period` starts with start(); until then only waiters look.
    Watchdog(std::string who, WatchedDevice device) : who_(std::move(who)), device_(std::move(device)) {}
    Watchdog(std::string who, WatchedDevice device, std::chrono::milliseconds period)
        : Watchdog(std::move(who), std::move(device)) {
        start(period);
    }
    Watchdog(const Watchdog&) = delete;
    Watchdog& operator=(const Watchdog&) = delete;
    ~Watchdog() { stop(); }

    // Starts the thread that looks every `period` (once; a zero period starts none).
    void start(std::chrono::milliseconds period) {
        if (period.count() <= 0 || watcher_) return;
        watcher_.emplace([period] { return detail::deadline_after<clock>(period); }, [this] { check(); },
                         [this] { enter_thread(); });
    }

    // Ends the thread; waiters still check. Idempotent.
    void stop() { watcher_.reset(); }

    // Runs f, one caller at a time, unless the communicator has failed (then throws why). The
    // device's communication calls go through here: an abort waits until f has returned, and a
    // failure found meanwhile is carried out as f leaves.
    template <class F>
    decltype(auto) run(F&& f) {
        std::lock_guard call(call_mutex_);
        struct Inside {
            Watchdog& dog;
            explicit Inside(Watchdog& d) : dog(d) { dog.enter(); }
            Inside(const Inside&) = delete;
            Inside& operator=(const Inside&) = delete;
            ~Inside() { dog.leave(); }
        } inside(*this);
        return f();
    }

    // Inside run(): polls a call that the device is still queueing (a non-blocking communicator's
    // "in progress") until it is done, fails, passes `timeout`, or the communicator is failed by
    // anyone (an abort request). Throws in the last three cases; the abort then runs as run() ends.
    template <class Poll>
    void settle(Poll&& poll, const std::string& what, std::chrono::milliseconds timeout) {
        const auto deadline = detail::deadline_after<clock>(timeout);
        for (int round = 0;; ++round) {
            const QueueState state = poll();
            if (state) {
                if (state->empty()) return;
                fail(who_ + ": " + what + " failed: " + *state + "; the communicator was aborted");
            }
            rethrow_if_failed();
            if (clock::now() >= deadline)
                fail(who_ + ": queueing " + what + " did not finish within " + std::to_string(timeout.count()) +
                         " ms; the communicator was aborted",
                     true);
            rethrow_if_failed();
            if (round < 64)
                std::this_thread::yield();
            else
                std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
    }

    // Runs f under the lock the device's callbacks run under, for state they share with calls.
    template <class F>
    decltype(auto) with_lock(F&& f) {
        std::lock_guard lock(mutex_);
        return f();
    }

    // Starts watching an op just queued; inside run().
    void watch(std::shared_ptr<WatchedOp> op) {
        std::lock_guard lock(mutex_);
        pending_.push_back(std::move(op));
    }

    // True once `op` completed or the communicator failed; never throws.
    [[nodiscard]] bool ready(const WatchedOp& op) {
        if (op.done.load(std::memory_order_acquire) || failed()) return true;
        try {
            check();
        } catch (...) {
        }
        return op.done.load(std::memory_order_acquire) || failed();
    }

    // Waits for `op` until it completes (true) or `until` passes (false). Throws when the
    // communicator fails first, which the op's own deadline guarantees it does if nothing else.
    bool wait_until(const WatchedOp& op, clock::time_point until) {
        for (int round = 0;; ++round) {
            if (op.done.load(std::memory_order_acquire)) return true;
            check();
            if (op.done.load(std::memory_order_acquire)) return true;
            rethrow_if_failed();
            if (clock::now() >= until) return false;
            if (round < 64)
                std::this_thread::yield();
            else
                std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }

    // Fails the communicator with `reason` (the first reason wins) and aborts the device: at
    // once when no call is inside run(), else as soon as that call leaves it.
    void fail(const std::string& reason, bool timed_out = false) {
        std::lock_guard lock(mutex_);
        fail_locked(reason, timed_out);
    }

    // Ends the watch quietly when its device goes away (the backend is destroyed): nothing is
    // aborted or printed, and a handle that outlives the backend throws `reason`.
    void close(const std::string& reason) {
        stop();
        std::lock_guard lock(mutex_);
        if (failed_.load(std::memory_order_relaxed)) {
            abort_due_ = false;  // the owner aborts, or has aborted, the device itself
            return;
        }
        error_ = std::make_exception_ptr(CollectiveError(reason));
        failed_.store(true, std::memory_order_release);
        pending_.clear();
    }

    // The ops not yet seen complete (a check() first retires those the device has finished);
    // none once the communicator failed.
    [[nodiscard]] PendingOps pending() const {
        std::lock_guard lock(mutex_);
        PendingOps out;
        for (const auto& op : pending_) {
            ++out.count;
            if (op->deadline > out.latest_deadline) out.latest_deadline = op->deadline;
            if (op->awaited.load(std::memory_order_acquire)) continue;
            if (out.abandoned++ == 0) out.first_abandoned = op->describe();
        }
        return out;
    }

    [[nodiscard]] bool failed() const { return failed_.load(std::memory_order_acquire); }
    // The device was aborted (not only asked to be).
    [[nodiscard]] bool aborted() const {
        std::lock_guard lock(mutex_);
        return aborted_;
    }

    void rethrow_if_failed() const {
        if (failed()) std::rethrow_exception(error_);
    }

    // One look: retires the ops the device finished, in order, then fails the communicator on a
    // device error or when the oldest op is past its deadline.
    void check() {
        std::lock_guard lock(mutex_);
        if (failed()) return;
        std::string why;
        try {
            while (!pending_.empty() && device_.finished(pending_.front()->event)) {
                auto op = std::move(pending_.front());
                pending_.pop_front();
                device_.release(op->event);
                op->finished_at = clock::now();
                op->done.store(true, std::memory_order_release);
            }
            why = device_.error();
        } catch (const std::exception& e) {
            why = e.what();
        }
        if (!why.empty()) {
            const std::string during = pending_.empty() ? "" : " during " + pending_.front()->describe();
            return fail_locked(who_ + ": the communicator failed" + during + ": " + why + "; it was aborted", false);
        }
        if (!pending_.empty() && clock::now() >= pending_.front()->deadline) {
            std::string peers;
            try {
                if (device_.peers) peers = device_.peers();
            } catch (const std::exception& e) {
                peers = std::string(" (where the peers stand is unknown: ") + e.what() + ")";
            }
            return fail_locked(who_ + ": " + pending_.front()->describe() +
                                   " did not complete by its deadline; the communicator was aborted. A peer has "
                                   "probably failed, left, or issued different collectives: its own error says more." +
                                   peers,
                               true);
        }
    }

    [[nodiscard]] const std::string& who() const { return who_; }

private:
    void enter() {
        std::lock_guard lock(mutex_);
        rethrow_if_failed();
        ++inside_;
    }

    void leave() {
        std::lock_guard lock(mutex_);
        if (--inside_ == 0 && abort_due_) abort_locked();
    }

    void fail_locked(const std::string& reason, bool timed_out) {
        if (failed_.load(std::memory_order_relaxed)) return;
        error_ = timed_out ? std::make_exception_ptr(TimeoutError(reason))
                           : std::make_exception_ptr(CollectiveError(reason));
        failed_.store(true, std::memory_order_release);
        // Printed as well: a rank blocked in its own stream synchronization never sees the exception.
        std::fprintf(stderr, "%s\n", reason.c_str());
        pending_.clear();  // never done: their waiters throw
        abort_due_ = true;
        if (inside_ == 0) abort_locked();
    }

    void abort_locked() {
        abort_due_ = false;
        if (aborted_) return;
        aborted_ = true;
        try {
            device_.abort();
        } catch (const std::exception& e) {
            std::fprintf(stderr, "%s: aborting the communicator failed too: %s\n", who_.c_str(), e.what());
        }
    }

    // First on the watcher's thread: select the device, or fail the communicator saying why not.
    void enter_thread() {
        try {
            if (device_.enter_thread) device_.enter_thread();
        } catch (const std::exception& e) {
            fail(who_ + ": the watchdog thread cannot reach the device: " + e.what());
        }
    }

    std::string who_;
    WatchedDevice device_;
    std::mutex call_mutex_;     // one call inside run() at a time
    mutable std::mutex mutex_;  // the state below; never held while a call polls
    std::deque<std::shared_ptr<WatchedOp>> pending_;
    int inside_ = 0;          // calls inside run()
    bool abort_due_ = false;  // failed while a call was inside: abort as it leaves
    bool aborted_ = false;
    std::atomic<bool> failed_{false};
    std::exception_ptr error_;              // written before failed_, read after it
    std::optional<WatcherThread> watcher_;  // last: its thread starts after the members it uses
};

}  // namespace gradsync::inline v0::detail
