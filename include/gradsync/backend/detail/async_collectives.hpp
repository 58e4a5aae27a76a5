// AsyncCollectives: a rank's asynchronous collectives, run in launch order on a progress thread
// started at the first launch. Synchronous collectives call wait_for_all() first, so that a
// rank's collectives keep one order whichever thread runs them. Shared by the host backends.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/detail/progress_thread.hpp>

#include <chrono>
#include <exception>
#include <memory>
#include <utility>  // for std::move

namespace gradsync::inline v0::detail {

class AsyncCollectives {
public:
    // Runs `body` on the progress thread after every earlier launch; `done` finishes with its
    // outcome (the exception it threw, if any).
    template <class F>
    void launch(F body, std::shared_ptr<Completion> done) {
        if (!thread_) thread_ = std::make_unique<ProgressThread>();
        thread_->post([body = std::move(body), done]() mutable {
            try {
                body();
                done->finish();
            } catch (...) {
                done->finish(std::current_exception());
            }
        });
        last_ = std::move(done);
    }

    // Waits until every launched collective has finished (each ends by its own deadline).
    void wait_for_all() {
        if (!last_) return;
        last_->wait_until(std::chrono::steady_clock::time_point::max());
        last_.reset();
    }

    // Drains the queue and stops the thread.
    void stop() {
        thread_.reset();
        last_.reset();
    }

private:
    std::unique_ptr<ProgressThread> thread_;
    std::shared_ptr<Completion> last_;
};

}  // namespace gradsync::inline v0::detail
