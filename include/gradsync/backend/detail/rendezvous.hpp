// Rendezvous: the meeting point of a group of threads, one per rank, each publishing what it is
// about to do (its call: buffers, sizes, an event) and waiting until every rank has published
// its own for the same round; each then sees all the calls. Every wait has a deadline, which
// names the ranks that did not come, and an abort ends every wait at once with its reason.
// The device LocalBackend (cuda/local_backend.cuh) is built on it.
#pragma once

#include <gradsync/detail/deadline.hpp>
#include <gradsync/error.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>  // for std::exception_ptr
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

template <class Call>
class Rendezvous {
public:
    Rendezvous(int size, std::chrono::milliseconds timeout)
        : size_(size), timeout_(timeout), rounds_(static_cast<std::size_t>(size), 0) {
        for (auto& calls : calls_) calls.resize(static_cast<std::size_t>(size));
    }

    [[nodiscard]] int size() const { return size_; }

    // Publishes `call` as this rank's next round and waits for every rank's. The calls stay valid
    // until this rank arrives again. `who` and `what` name the rank and the operation in errors.
    std::span<const Call> arrive(int rank, const Call& call, const std::string& who, const std::string& what) {
        std::unique_lock lock(mutex_);
        rethrow_if_failed();
        const auto me = static_cast<std::size_t>(rank);
        const std::uint64_t round = ++rounds_[me];
        auto& calls = calls_[round % 2];
        calls[me] = call;
        cv_.notify_all();
        const auto deadline = detail::deadline_after(timeout_);
        const auto everyone_here = [&] {
            for (auto r : rounds_)
                if (r < round) return false;
            return true;
        };
        while (!everyone_here()) {
            rethrow_if_failed();
            if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !everyone_here()) {
                std::string missing;
                for (std::size_t r = 0; r < rounds_.size(); ++r)
                    if (rounds_[r] < round) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
                fail_locked(who + ": " + what + " waited " + std::to_string(timeout_.count()) + " ms for rank" +
                                (missing.find(',') == std::string::npos ? " " : "s ") + missing +
                                ", which did not reach it; the group was aborted",
                            true);
                rethrow_if_failed();
            }
        }
        rethrow_if_failed();
        return calls;
    }

    // Ends every wait, now and later, with `reason` (the first reason wins).
    void abort(const std::string& reason) {
        std::lock_guard lock(mutex_);
        fail_locked(reason, false);
    }

    [[nodiscard]] bool failed() const {
        std::lock_guard lock(mutex_);
        return error_ != nullptr;
    }

    // Throws the group's failure, if there was one.
    void throw_if_failed() const {
        std::lock_guard lock(mutex_);
        rethrow_if_failed();
    }

private:
    void rethrow_if_failed() const {  // under mutex_
        if (error_) std::rethrow_exception(error_);
    }

    void fail_locked(const std::string& reason, bool timed_out) {
        if (error_) return;
        error_ = timed_out ? std::make_exception_ptr(TimeoutError(reason))
                           : std::make_exception_ptr(CollectiveError(reason));
        cv_.notify_all();
    }

    int size_;
    std::chrono::milliseconds timeout_;
    mutable std::mutex mutex_;
    std::condition_variable cv_;
    std::vector<std::uint64_t> rounds_;  // per rank: rounds arrived at
    std::vector<Call> calls_[2];         // by round parity: a slow rank still reads the last round's
    std::exception_ptr error_;
};

}  // namespace gradsync::inline v0::detail
