// Waiting without burning a core and without sleeping through a wake-up: spin briefly (the
// common case, when the peer is running on another core), then yield, then sleep on a Doorbell.
#pragma once

#include <gradsync/version.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>  // for std::this_thread::yield

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

// How long a waiter spins before yielding and then sleeping.
struct SpinPolicy {
    std::uint32_t spins = 1u << 14;  // busy iterations with a pause instruction
    std::uint32_t yields = 1u << 8;  // sched_yield calls after that
    std::chrono::nanoseconds sleep_slice = std::chrono::milliseconds(5);

    // Spinning only pays when every waiting thread has a core of its own.
    static SpinPolicy for_threads(unsigned threads) {
        SpinPolicy p;
        unsigned cores = std::thread::hardware_concurrency();
        if (cores != 0 && threads > cores) {
            p.spins = 64;
            p.yields = 64;
        }
        return p;
    }
};

// Waits until ready() holds. check() runs every few hundred spins and on every wake-up; it throws
// to end the wait (abort, deadline). Returns as soon as ready() is seen.
template <class Ready, class Check>
void wait_until(Ready&& ready, Check&& check, Doorbell& bell, const SpinPolicy& policy) {
    for (std::uint32_t i = 0; i < policy.spins; ++i) {
        if (ready()) return;
        if ((i & 255u) == 255u) check();
        cpu_relax();
    }
    for (std::uint32_t i = 0; i < policy.yields; ++i) {
        if (ready()) return;
        check();
        std::this_thread::yield();
    }
    while (!ready()) {
        check();
        bell.sleep(ready, policy.sleep_slice);
    }
}

}  // namespace gradsync::inline v0::detail
