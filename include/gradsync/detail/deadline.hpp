// Deadlines from timeouts: now + timeout, saturated at the latest time the clock can hold, so
// that a huge timeout (std::chrono::milliseconds::max(), say) means "wait forever" instead of
// overflowing into a deadline in the past.
#pragma once

#include <gradsync/version.hpp>

#include <chrono>

namespace gradsync::inline v0::detail {

template <class Clock = std::chrono::steady_clock, class Rep, class Period>
typename Clock::time_point deadline_after(std::chrono::duration<Rep, Period> timeout) {
    const auto now = Clock::now();
    // Compared in floating seconds, a second short to absorb rounding: converting a huge timeout
    // to the clock's ticks would overflow.
    using seconds = std::chrono::duration<double>;
    if (seconds(timeout) >= seconds(Clock::time_point::max() - now) - seconds(1)) return Clock::time_point::max();
    return now + std::chrono::duration_cast<typename Clock::duration>(timeout);
}

}  // namespace gradsync::inline v0::detail
