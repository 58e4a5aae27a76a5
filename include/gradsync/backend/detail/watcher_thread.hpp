// WatcherThread: the one deadline watcher every backend uses. A thread of its own sleeps until
// the time its owner names (asked afresh each time it wakes), then runs the owner's check, and
// ends with the object. MpiBackend wakes at the running collective's deadline, the MPI join at
// its own, and the NCCL watchdog every period to look at the device.
#pragma once

#include <gradsync/version.hpp>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>  // for std::move

namespace gradsync::inline v0::detail {

class WatcherThread {
public:
    using clock = std::chrono::steady_clock;

    // `wake_at()` says when to wake next (time_point::max(): not before notify()); `on_wake()`
    // runs once that time has passed. Both run on the watcher's thread, without its lock: they
    // take the owner's. `on_start()`, when given, runs first on that thread.
    WatcherThread(std::function<clock::time_point()> wake_at, std::function<void()> on_wake,
                  std::function<void()> on_start = {})
        : wake_at_(std::move(wake_at)), on_wake_(std::move(on_wake)) {
        thread_ = std::thread([this, on_start = std::move(on_start)] {
            if (on_start) on_start();
            run();
        });
    }
    WatcherThread(const WatcherThread&) = delete;
    WatcherThread& operator=(const WatcherThread&) = delete;
    ~WatcherThread() { stop(); }

    // Makes the thread ask wake_at() again now (an earlier deadline than it sleeps towards).
    void notify() {
        {
            std::lock_guard lock(mutex_);
            ++notified_;
        }
        cv_.notify_all();
    }

    // Ends the thread and waits for it. Idempotent; not from the thread itself.
    void stop() {
        {
            std::lock_guard lock(mutex_);
            stopping_ = true;
        }
        cv_.notify_all();
        if (thread_.joinable()) thread_.join();
    }

private:
    void run() {
        for (;;) {
            unsigned long seen = 0;
            {
                std::lock_guard lock(mutex_);
                if (stopping_) return;
                seen = notified_;  // before asking: a notify() from here on is not lost
            }
            const auto until = wake_at_();
            {
                std::unique_lock lock(mutex_);
                const auto woken = [&] { return stopping_ || notified_ != seen; };
                if (until == clock::time_point::max())
                    cv_.wait(lock, woken);
                else
                    cv_.wait_until(lock, until, woken);
                if (stopping_) return;
            }
            if (clock::now() >= until) on_wake_();
        }
    }

    std::function<clock::time_point()> wake_at_;
    std::function<void()> on_wake_;
    std::mutex mutex_;
    std::condition_variable cv_;
    bool stopping_ = false;
    unsigned long notified_ = 0;
    std::thread thread_;  // last: starts after the members it uses
};

}  // namespace gradsync::inline v0::detail
