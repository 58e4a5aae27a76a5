// One stream's worker in the stand-in CUDA runtime: a thread that runs the stream's work in the
// order it was queued, each piece with a ticket that tells when it is done. The thread ends once
// the queue is closed and drained; it owns the queue, so a stream destroyed with work queued
// finishes that work first, as a GPU does.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>  // for std::move

namespace standin::detail {

class WorkQueue : public std::enable_shared_from_this<WorkQueue> {
public:
    static std::shared_ptr<WorkQueue> start() {
        auto queue = std::shared_ptr<WorkQueue>(new WorkQueue);
        std::thread([queue] { queue->work(); }).detach();
        return queue;
    }

    // Queues `task`; returns its ticket.
    std::uint64_t push(std::function<void()> task) {
        std::lock_guard lock(mutex_);
        tasks_.push_back(std::move(task));
        const std::uint64_t ticket = ++queued_;
        changed_.notify_all();
        return ticket;
    }

    [[nodiscard]] std::uint64_t last_ticket() const {
        std::lock_guard lock(mutex_);
        return queued_;
    }
    [[nodiscard]] bool done(std::uint64_t ticket) const {
        std::lock_guard lock(mutex_);
        return finished_ >= ticket;
    }
    void wait_done(std::uint64_t ticket) const {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return finished_ >= ticket; });
    }

    // Work queued after this starts `delay` late.
    void set_delay(std::chrono::microseconds delay) { delay_us_.store(delay.count()); }

    // The thread ends after the work queued so far.
    void close() {
        std::lock_guard lock(mutex_);
        closed_ = true;
        changed_.notify_all();
    }

private:
    WorkQueue() = default;

    void work() {
        for (;;) {
            std::function<void()> task;
            {
                std::unique_lock lock(mutex_);
                changed_.wait(lock, [&] { return closed_ || !tasks_.empty(); });
                if (tasks_.empty()) return;
                task = std::move(tasks_.front());
                tasks_.pop_front();
            }
            if (const auto delay = delay_us_.load(); delay > 0)
                std::this_thread::sleep_for(std::chrono::microseconds(delay));
            task();
            std::lock_guard lock(mutex_);
            ++finished_;
            changed_.notify_all();
        }
    }

    mutable std::mutex mutex_;
    mutable std::condition_variable changed_;
    std::deque<std::function<void()>> tasks_;
    std::uint64_t queued_ = 0, finished_ = 0;
    bool closed_ = false;
    std::atomic<std::int64_t> delay_us_{0};
};

}  // namespace standin::detail
