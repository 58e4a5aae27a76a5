// How a failure on one rank becomes the group's: the group is aborted (where the backend can be),
// so that peers waiting in collectives fail at once rather than at their deadline; the
// collectives in flight are drained; the error goes on. An error every rank raised alike
// (RaisedOnEveryRank) needs no abort: under MPI an abort would end the job.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/group_label.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/error.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>

namespace gradsync::inline v0::detail {

// Aborts the group of `backend` with `reason`, where it can be aborted and has peers.
template <class Backend>
void abort_group(Backend& backend, const std::string& reason) {
    if constexpr (Abortable<Backend>)
        if (backend.size() > 1) backend.abort(reason);
}

// Runs f. On an exception: aborts the group (unless every rank raised it alike) with
// reason(exception), drains the engine's collectives up to `timeout` from now, calls end_step()
// and rethrows.
template <class Backend, class Engine, class F, class EndStep, class Reason>
void run_guarded(Backend& backend, Engine& engine, std::chrono::milliseconds timeout, F&& f, EndStep&& end_step,
                 Reason&& reason) {
    try {
        f();
    } catch (const RaisedOnEveryRank&) {
        end_step();
        throw;
    } catch (const std::exception& e) {
        abort_group(backend, reason(e));
        engine.drain(detail::deadline_after(timeout));
        end_step();
        throw;
    }
}
// ...telling the peers the exception's own words.
template <class Backend, class Engine, class F, class EndStep>
void run_guarded(Backend& backend, Engine& engine, std::chrono::milliseconds timeout, F&& f, EndStep&& end_step) {
    run_guarded(backend, engine, timeout, f, end_step, [](const std::exception& e) { return std::string(e.what()); });
}

// What peers are told of an exception on this rank in `step`: gradsync's own errors already say
// which rank and where; the trainer's (an optimizer that threw) are prefixed with both.
inline std::string failure_of(const std::string& who, std::uint64_t step, const std::exception& e) {
    const std::string what = e.what();
    if (what.rfind("gradsync: ", 0) == 0) return what;
    return who + " failed in step " + std::to_string(step) + ": " + what;
}

// For a front's destructor: with collectives still in flight (a step cut short by an exception),
// aborts the group, saying that this rank destroyed its `front` in `step`, and drains them. Never
// throws.
template <class Backend, class Engine>
void abandon_in_flight(Backend& backend, Engine& engine, std::chrono::milliseconds timeout, const char* front,
                       std::uint64_t step) noexcept {
    try {
        if (!engine.in_flight()) return;
        abort_group(backend, who(backend) + " destroyed its " + front + " in step " + std::to_string(step) +
                                 " with collectives in flight");
        engine.drain(detail::deadline_after(timeout));
    } catch (...) {  // a destructor must not throw
    }
}

}  // namespace gradsync::inline v0::detail
