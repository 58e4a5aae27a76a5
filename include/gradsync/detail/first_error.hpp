// FirstError: the first exception thrown by any thread of a group (the cause, not the failures
// it then causes in the others), kept to rethrow once they have all ended.
#pragma once

#include <gradsync/version.hpp>

#include <exception>
#include <mutex>
#include <string>

namespace gradsync::inline v0::detail {

class FirstError {
public:
    // In a catch handler: keeps the exception being handled if it is the first, and returns its
    // what() for the message that tells the others.
    std::string keep_current() {
        std::string what = "unknown exception";
        try {
            throw;
        } catch (const std::exception& e) {
            what = e.what();
        } catch (...) {
        }
        std::lock_guard lock(mutex_);
        if (!first_) first_ = std::current_exception();
        return what;
    }

    [[nodiscard]] bool any() const {
        std::lock_guard lock(mutex_);
        return first_ != nullptr;
    }

    // After the threads have ended.
    void rethrow_if_any() const {
        if (first_) std::rethrow_exception(first_);
    }

private:
    mutable std::mutex mutex_;
    std::exception_ptr first_;
};

}  // namespace gradsync::inline v0::detail
