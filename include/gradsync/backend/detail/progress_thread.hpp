// ProgressThread: runs a rank's asynchronous collectives, in launch order, on a thread of its
// own, so that the caller returns to backward while they progress.
#pragma once

#include <gradsync/version.hpp>

#include <condition_variable>
#include <deque>
#include <functional>  // for std::function
#include <mutex>
#include <thread>
#include <utility>  // for std::move

namespace gradsync::inline v0::detail {

class ProgressThread {
public:
    ProgressThread() : thread_([this] { run(); }) {}
    ProgressThread(const ProgressThread&) = delete;
    ProgressThread& operator=(const ProgressThread&) = delete;
    ~ProgressThread() {
        {
            std::lock_guard lock(mutex_);
            stop_ = true;
        }
        cv_.notify_one();
        thread_.join();  // after the queue is drained
    }

    void post(std::function<void()> task) {
        {
            std::lock_guard lock(mutex_);
            queue_.push_back(std::move(task));
        }
        cv_.notify_one();
    }

private:
    void run() {
        std::unique_lock lock(mutex_);
        for (;;) {
            cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stop_ and nothing left
            auto task = std::move(queue_.front());
            queue_.pop_front();
            lock.unlock();
            task();
            lock.lock();
        }
    }

    std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<std::function<void()>> queue_;
    bool stop_ = false;
    std::thread thread_;  // last: starts after the members it uses
};

}  // namespace gradsync::inline v0::detail
