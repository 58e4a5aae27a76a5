// Waiting without holding a core another thread needs and without sleeping through a wake-up:
// spin while spinning has lately paid, yield while nobody else wants the core, then sleep.
#pragma once

#include <gradsync/version.hpp>

#include <algorithm>  // for std::clamp, std::min
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>  // for std::this_thread::yield, sleep_for

namespace gradsync::inline v0::detail {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// Wakes the threads that went to sleep waiting for some shared state to change. Ringing costs a
// single load when nobody sleeps, so the fast path never enters the kernel.
class Doorbell {
public:
    // Call after publishing the change (with a seq_cst store or read-modify-write).
    void ring() {
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            std::lock_guard lock(mutex_);
            cv_.notify_all();
        }
    }

    // Sleeps until `ready()` holds, someone rings, or `slice` passes, whichever is first.
    template <class Ready>
    void sleep(Ready&& ready, std::chrono::nanoseconds slice) {
        std::unique_lock lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (!ready()) cv_.wait_for(lock, slice);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }

private:
    std::mutex mutex_;
    std::condition_variable cv_;
    std::atomic<int> sleepers_{0};
};

// Sleeps a fixed short time, for waiters whose peers cannot ring a Doorbell (they live in another
// process): its length bounds how late such a waiter wakes.
class Nap {
public:
    explicit constexpr Nap(std::chrono::nanoseconds length) : length_(length) {}

    template <class Ready>
    void sleep(Ready&& /*ready*/, std::chrono::nanoseconds slice) const {
        std::this_thread::sleep_for(std::min(length_, slice));
    }

private:
    std::chrono::nanoseconds length_;
};

// How long a waiter spins on the pause instruction, learnt from how its recent waits ended.
// Spinning pays only while the thread it waits for runs on another core; when that thread waits
// for a core, as beside a trainer's own compute threads, every spin delays it. A wait that ends
// while spinning lets the next one spin a quarter longer; one that outlasts its spin halves it.
class SpinBudget {
public:
    static constexpr std::chrono::nanoseconds least{1'000};
    static constexpr std::chrono::nanoseconds most{64'000};

    SpinBudget() = default;
    SpinBudget(const SpinBudget&) = delete;
    SpinBudget& operator=(const SpinBudget&) = delete;

    [[nodiscard]] std::chrono::nanoseconds get() const {
        return std::chrono::nanoseconds(ns_.load(std::memory_order_relaxed));
    }
    // A lost update between two waiters sharing a budget only delays the learning.
    void paid() { ns_.store(clamp(get().count() + get().count() / 4), std::memory_order_relaxed); }
    void wasted() { ns_.store(clamp(get().count() / 2), std::memory_order_relaxed); }

private:
    static std::int64_t clamp(std::int64_t ns) { return std::clamp(ns, least.count(), most.count()); }

    std::atomic<std::int64_t> ns_{most.count()};
};

// After the spin, a waiter yields until this long after it began: a thread that sleeps lets its
// core idle, and waking an idle core (a virtual machine's above all) can take a millisecond.
inline constexpr std::chrono::nanoseconds yield_for = std::chrono::microseconds(200);
// A yield that returns this late means another thread wanted the core: sleep and leave it to
// them; the kernel wakes a sleeper ahead of busy threads, a yielder only behind them.
inline constexpr std::chrono::nanoseconds contended_yield = std::chrono::microseconds(10);
inline constexpr std::chrono::nanoseconds sleep_slice = std::chrono::milliseconds(5);

// Waits until ready() holds: spins for the budget, yields, then sleeps on `bell` (a Doorbell, or
// a Nap). check() runs every few hundred spins and on every yield and wake-up; it throws to end
// the wait (abort, deadline). Returns as soon as ready() is seen.
template <class Ready, class Check, class Sleeper>
void wait_until(Ready&& ready, Check&& check, Sleeper&& bell, SpinBudget& budget) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto stop_spinning = start + budget.get();
    for (std::uint32_t i = 1;; ++i) {
        if (ready()) {
            budget.paid();
            return;
        }
        if (i % 256 == 0) check();
        if (i % 16 == 0 && clock::now() >= stop_spinning) break;
        cpu_relax();
    }
    budget.wasted();
    for (auto now = clock::now(); now < start + yield_for;) {
        if (ready()) return;
        check();
        std::this_thread::yield();
        const auto before = now;
        now = clock::now();
        if (now - before > contended_yield) break;
    }
    while (!ready()) {
        check();
        bell.sleep(ready, sleep_slice);
    }
}

}  // namespace gradsync::inline v0::detail
