// What a front measures of each step for its report: the optimizer timed (its time is not
// synchronization), and the report's times and bytes filled in at the end of step().
#pragma once

#include <gradsync/data_parallel/finalize_step.hpp>

#include <algorithm>  // for std::max
#include <chrono>
#include <concepts>  // for std::invocable
#include <cstdint>
#include <utility>

namespace gradsync::inline v0::detail {

// The optimizer a step() calls, with the time spent in it added up.
template <class F>
class TimedOptimizer {
public:
    explicit TimedOptimizer(F& f) : f_(f) {}
    template <class... A>
    requires std::invocable<F&, A...>
    decltype(auto) operator()(A&&... a) {
        const Stopwatch watch{seconds_};
        return f_(std::forward<A>(a)...);
    }
    [[nodiscard]] double seconds() const { return seconds_; }

private:
    struct Stopwatch {
        double& total;
        std::chrono::steady_clock::time_point began = std::chrono::steady_clock::now();
        ~Stopwatch() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count(); }
    };
    F& f_;
    double seconds_ = 0;
};

// The step's own measurements: since the previous step() returned, the time and the bytes of the
// gradients' collectives; in this step() outside the optimizer, the time of synchronization.
class StepClock {
public:
    void fill(StepReport& report, std::chrono::steady_clock::time_point began, double optimizer_seconds,
              std::uint64_t bytes_so_far) {
        const auto now = std::chrono::steady_clock::now();
        report.sync_seconds = std::max(0.0, std::chrono::duration<double>(now - began).count() - optimizer_seconds);
        report.step_seconds = std::chrono::duration<double>(now - last_).count();
        report.bytes_reduced = bytes_so_far - bytes_;
        last_ = now;
        bytes_ = bytes_so_far;
    }

private:
    std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
    std::uint64_t bytes_ = 0;
};

}  // namespace gradsync::inline v0::detail
