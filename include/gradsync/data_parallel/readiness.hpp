// Readiness: which parameters' gradients are final in the current step, which buckets that
// completes, and the order buckets may go in: plan order, whatever order gradients arrive in, so
// that every rank launches the same collectives in the same order. Also no_sync() (accumulation
// micro-steps), the readiness order the first step saw (for a bucket rebuild) and, while buckets
// are tuned, when each gradient became ready. grad_ready may
// come from several threads (backward hooks); a peer's diagnosis reads the state from another.
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::fill, std::max, std::min
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <utility>  // for std::exchange
#include <vector>

namespace gradsync::inline v0 {

// synchronize() found parameters that never got grad_ready (and find_unused_parameters is off),
// or grad_ready was misused. Peers receive the same message in a CollectiveError.
class ReadinessError : public Error {
public:
    using Error::Error;
};

namespace detail {

class Readiness {
public:
    enum class Phase : int { idle, backward, synchronizing };
    // What a grad_ready found.
    enum class Mark : std::uint8_t {
        accepted,     // ready for this step
        accumulated,  // under no_sync(): only noted as used
        twice,        // already ready this step: a misuse
    };

    // The buckets of `plan` over `params` parameters. Between steps.
    void plan(const BucketPlan& plan, std::size_t params) {
        if (!ready_ || params != params_) {
            params_ = params;
            ready_ = std::make_unique<std::atomic<std::uint8_t>[]>(params);
            used_ = std::make_unique<std::atomic<std::uint8_t>[]>(params);
        }
        bucket_of_.assign(params, 0);
        sizes_.clear();
        for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
            for (auto p : plan.buckets[b].parameters) bucket_of_[p] = b;
            sizes_.push_back(plan.buckets[b].parameters.size());
        }
        pending_ = std::make_unique<std::atomic<std::int32_t>[]>(sizes_.size());
        std::lock_guard lock(mutex_);
        complete_.assign(sizes_.size(), 0);
        completed_at_.assign(sizes_.size(), {});
        reset_locked();
    }

    // Keeps the order in which parameters become ready, until stop_recording().
    void record_arrivals() { arrivals_.resize(params_); }
    [[nodiscard]] std::vector<std::size_t> arrivals() const {
        const auto n = std::min(arrived_.load(std::memory_order_acquire), arrivals_.size());
        return {arrivals_.begin(), arrivals_.begin() + static_cast<std::ptrdiff_t>(n)};
    }
    void stop_recording() {
        arrivals_.clear();
        arrivals_.shrink_to_fit();
    }
    [[nodiscard]] std::size_t recording_capacity() const { return arrivals_.capacity() + ready_at_.capacity(); }

    // Notes when each parameter becomes ready (one clock read per grad_ready), until switched off.
    // Between steps.
    void time_arrivals(bool on) {
        if (on) {
            ready_at_.assign(params_, {});
        } else {
            ready_at_.clear();
            ready_at_.shrink_to_fit();
        }
    }
    [[nodiscard]] bool timing_arrivals() const { return !ready_at_.empty(); }
    // Per parameter, seconds after the step's first grad_ready that it became ready (at
    // synchronize() for those completed there). After an overlapped step, while timing.
    [[nodiscard]] std::vector<double> ready_offsets() const {
        std::vector<double> out;
        out.reserve(ready_at_.size());
        for (auto t : ready_at_) out.push_back(std::max(0.0, std::chrono::duration<double>(t - began_).count()));
        return out;
    }

    // Parameter p's gradient is final. When that completes a bucket, calls launch(b) for it and
    // for every complete bucket after it that may go now, in plan order, under the lock.
    template <class Launch>
    Mark mark(std::size_t p, Launch&& launch) {
        if (no_sync_.load(std::memory_order_relaxed) > 0) {
            used_[p].store(1, std::memory_order_relaxed);
            return Mark::accumulated;
        }
        if (ready_[p].exchange(1, std::memory_order_acq_rel) != 0) return Mark::twice;
        used_[p].store(1, std::memory_order_relaxed);
        if (!any_.exchange(true, std::memory_order_acq_rel)) {
            began_ = std::chrono::steady_clock::now();
            phase_.store(Phase::backward, std::memory_order_release);
        }
        if (!ready_at_.empty()) ready_at_[p] = std::chrono::steady_clock::now();  // p is this thread's alone
        if (!arrivals_.empty()) {
            const auto at = arrived_.fetch_add(1, std::memory_order_relaxed);
            if (at < arrivals_.size()) arrivals_[at] = p;
        }
        const auto b = bucket_of_[p];
        if (pending_[b].fetch_sub(1, std::memory_order_acq_rel) == 1) {
            std::lock_guard lock(mutex_);
            bucket_complete_locked(b, launch);
        }
        return Mark::accepted;
    }

    // At synchronize(): every parameter without grad_ready this step was either accumulated in a
    // no_sync() micro-step (its sum is final), or is unused: then `unused(p)` decides, returning
    // true when it counts as ready (a zero gradient). Every bucket is launched. Returns the
    // parameters that are neither.
    template <class Launch, class Unused>
    std::vector<std::size_t> complete(Launch&& launch, Unused&& unused) {
        std::lock_guard lock(mutex_);
        std::vector<std::size_t> missing;
        for (std::size_t p = 0; p < params_; ++p) {
            if (ready_[p].load(std::memory_order_acquire) != 0) continue;
            if (used_[p].load(std::memory_order_relaxed) != 0 || unused(p)) {
                ready_[p].store(1, std::memory_order_release);
                if (!ready_at_.empty()) ready_at_[p] = std::chrono::steady_clock::now();
                const auto b = bucket_of_[p];
                if (pending_[b].fetch_sub(1, std::memory_order_acq_rel) == 1) bucket_complete_locked(b, launch);
            } else {
                missing.push_back(p);
            }
        }
        return missing;
    }

    // After a step (or a failed one): nothing is ready, nothing launched.
    void reset() {
        std::lock_guard lock(mutex_);
        reset_locked();
    }

    // While a guard lives, gradients only accumulate: grad_ready() notes the parameter as used and
    // synchronize() communicates nothing.
    class NoSyncGuard {
    public:
        explicit NoSyncGuard(Readiness& r) : r_(&r) { r_->no_sync_.fetch_add(1); }
        NoSyncGuard(NoSyncGuard&& o) noexcept : r_(std::exchange(o.r_, nullptr)) {}
        NoSyncGuard(const NoSyncGuard&) = delete;
        NoSyncGuard& operator=(const NoSyncGuard&) = delete;
        NoSyncGuard& operator=(NoSyncGuard&&) = delete;
        ~NoSyncGuard() {
            if (r_) r_->no_sync_.fetch_sub(1);
        }

    private:
        Readiness* r_;
    };
    [[nodiscard]] bool accumulating() const { return no_sync_.load(std::memory_order_acquire) > 0; }

    // Some grad_ready came this step: synchronize() finds buckets launched during backward.
    [[nodiscard]] bool any_ready() const { return any_.load(std::memory_order_acquire); }
    // When the first of them came (read after every grad_ready of the step has returned).
    [[nodiscard]] std::chrono::steady_clock::time_point began() const { return began_; }
    [[nodiscard]] Phase phase() const { return phase_.load(std::memory_order_acquire); }
    void set_phase(Phase p) { phase_.store(p, std::memory_order_release); }
    [[nodiscard]] std::size_t launched() const { return launched_.load(std::memory_order_acquire); }
    [[nodiscard]] bool ready(std::size_t p) const { return ready_[p].load(std::memory_order_acquire) != 0; }
    [[nodiscard]] std::size_t bucket_of(std::size_t p) const { return bucket_of_[p]; }
    // When bucket b's last gradient became ready this step (read after synchronize()'s waits).
    [[nodiscard]] std::chrono::steady_clock::time_point completed_at(std::size_t b) const { return completed_at_[b]; }
    [[nodiscard]] std::size_t buckets() const { return sizes_.size(); }

private:
    template <class Launch>
    void bucket_complete_locked(std::size_t b, Launch& launch) {
        complete_[b] = 1;
        completed_at_[b] = std::chrono::steady_clock::now();
        while (next_ < complete_.size() && complete_[next_]) launch(next_++);
        launched_.store(next_, std::memory_order_release);
    }

    void reset_locked() {
        for (std::size_t p = 0; p < params_; ++p) {
            ready_[p].store(0, std::memory_order_relaxed);
            used_[p].store(0, std::memory_order_relaxed);
        }
        for (std::size_t b = 0; b < sizes_.size(); ++b)
            pending_[b].store(static_cast<std::int32_t>(sizes_[b]), std::memory_order_relaxed);
        std::fill(complete_.begin(), complete_.end(), 0);
        next_ = 0;
        launched_.store(0, std::memory_order_release);
        arrived_.store(0, std::memory_order_relaxed);
        any_.store(false, std::memory_order_release);
    }

    std::size_t params_ = 0;
    std::vector<std::size_t> bucket_of_;  // per parameter
    std::vector<std::size_t> sizes_;      // per bucket, its parameters
    // Atomics: grad_ready may come from several threads, and a peer's diagnosis reads them.
    std::unique_ptr<std::atomic<std::uint8_t>[]> ready_;    // grad_ready this step
    std::unique_ptr<std::atomic<std::uint8_t>[]> used_;     // grad_ready since the last synchronized step
    std::unique_ptr<std::atomic<std::int32_t>[]> pending_;  // per bucket, parameters not yet ready
    std::atomic<bool> any_{false};
    std::chrono::steady_clock::time_point began_;  // written by the first grad_ready of a step
    std::atomic<int> no_sync_{0};
    std::atomic<Phase> phase_{Phase::idle};
    std::atomic<std::size_t> launched_{0};
    std::mutex mutex_;
    std::vector<std::uint8_t> complete_;                               // under mutex_
    std::vector<std::chrono::steady_clock::time_point> completed_at_;  // under mutex_
    std::size_t next_ = 0;                                             // the next bucket to launch, under mutex_
    std::vector<std::size_t> arrivals_;                                // readiness order, recorded until the rebuild
    std::atomic<std::size_t> arrived_{0};
    std::vector<std::chrono::steady_clock::time_point> ready_at_;  // per parameter, while timing
};

}  // namespace detail
}  // namespace gradsync::inline v0
