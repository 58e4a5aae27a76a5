// What MpiBackend's watcher thread watches: the collective running now and its deadline, the
// peers that have left the group, and the status reporters it quotes when it ends the job. The
// collectives' threads write it, the watcher reads it; one mutex guards each half.
#pragma once

#include <gradsync/backend/collective.hpp>  // for CollectiveCall
#include <gradsync/backend/mpi/departures.hpp>
#include <gradsync/backend/mpi/peer_standings.hpp>  // for Standing
#include <gradsync/detail/deadline.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::min
#include <chrono>
#include <cstdint>
#include <cstdio>      // for std::snprintf
#include <functional>  // for std::function
#include <mutex>
#include <optional>
#include <string>
#include <utility>  // for std::move, std::pair
#include <vector>

namespace gradsync::inline v0::detail {

class CollectiveWatch {
public:
    using Clock = std::chrono::steady_clock;

    // `who` begins every message ("gradsync: rank 1 of 2", or names the rank's group).
    CollectiveWatch(std::string who, std::chrono::milliseconds timeout) : who_(std::move(who)), timeout_(timeout) {}

    // `call` starts on this thread now: refused with a CollectiveError when a rank it needs has
    // left. Kept as it is and described only for a message (describing every call cost a
    // small allreduce a tenth of its time).
    void start(const CollectiveCall& call) {
        std::lock_guard lock(mutex_);
        if (const auto* gone = departed_before(call.seq))
            throw CollectiveError(who_ + ": " + call.describe() + " cannot complete: " + gone->describe());
        current_ = call;
        deadline_ = detail::deadline_after<Clock>(timeout_);
        busy_ = true;
    }
    // It ended, `completed` or by an exception.
    void stop(std::uint64_t seq, bool completed) {
        std::lock_guard lock(mutex_);
        busy_ = false;
        if (completed) last_completed_ = seq;
    }
    [[nodiscard]] std::uint64_t last_completed() {
        std::lock_guard lock(mutex_);
        return last_completed_;
    }

    // When the watcher should look next: the running collective's deadline, or one timeout from
    // now when none runs (a collective that starts meanwhile has a later deadline, so nothing on
    // the collectives' path ever needs to wake the watcher); and every `poll` while polling.
    [[nodiscard]] Clock::time_point wake_at(std::optional<std::chrono::milliseconds> poll) {
        std::lock_guard lock(mutex_);
        const auto due = busy_ ? deadline_ : detail::deadline_after<Clock>(timeout_);
        return poll ? std::min(due, detail::deadline_after<Clock>(*poll)) : due;
    }

    // Peers that said farewell. When the running collective needs one of them it can never
    // complete: returns what to say before ending the job.
    [[nodiscard]] std::optional<std::string> note_departures(const std::vector<Departure>& arrived) {
        if (arrived.empty()) return std::nullopt;
        std::string what, why;
        {
            std::lock_guard lock(mutex_);
            departed_.insert(departed_.end(), arrived.begin(), arrived.end());
            if (!busy_) return std::nullopt;
            const auto* gone = departed_before(current_.seq);
            if (!gone) return std::nullopt;
            what = current_.describe();
            why = gone->describe();
        }
        return who_ + ": " + why + "; " + what + ", which this rank is in, needs it and can never complete" +
               where_this_rank_is() + ". MPI cannot cancel a collective, so this rank ends the job.";
    }

    // When the running collective is past its deadline: what to say before ending the job.
    [[nodiscard]] std::optional<std::string> late() {
        std::string what;
        {
            std::lock_guard lock(mutex_);
            if (!busy_ || Clock::now() < deadline_) return std::nullopt;
            what = current_.describe();
        }
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%.3g", std::chrono::duration<double>(timeout_).count());
        return who_ + ": " + what + " has not completed after " + seconds + " s (MpiOptions::timeout)" +
               where_this_rank_is() +
               ". A peer rank is late, has exited, or called a different collective; MPI cannot cancel a "
               "collective, so this rank ends the job.";
    }

    [[nodiscard]] std::vector<int> departed_ranks() {
        std::lock_guard lock(mutex_);
        std::vector<int> ranks;
        for (const auto& d : departed_) ranks.push_back(d.rank);
        return ranks;
    }

    // Where this rank stands, for a peer that asks (peer_standings.hpp): collectives completed, the
    // one it waits in, what its status reporters say.
    [[nodiscard]] Standing standing() {
        Standing out;
        {
            std::lock_guard lock(mutex_);
            out.completed = last_completed_;
            out.in_collective = busy_;
            if (busy_) out.words = "waits in " + current_.describe();
        }
        std::lock_guard lock(reporters_mutex_);
        for (const auto& r : reporters_) out.words += (out.words.empty() ? "" : "; ") + r.second();
        return out;
    }

    std::uint64_t add_reporter(std::function<std::string()> reporter) {
        std::lock_guard lock(reporters_mutex_);
        reporters_.emplace_back(++next_reporter_, std::move(reporter));
        return next_reporter_;
    }
    void remove_reporter(std::uint64_t id) {
        std::lock_guard lock(reporters_mutex_);
        std::erase_if(reporters_, [id](const auto& r) { return r.first == id; });
    }

private:
    // The first peer that left before collective #seq, which therefore can never complete. Under
    // mutex_.
    [[nodiscard]] const Departure* departed_before(std::uint64_t seq) const {
        for (const auto& d : departed_)
            if (d.last_completed < seq) return &d;
        return nullptr;
    }

    std::string where_this_rank_is() {
        std::string where;
        std::lock_guard lock(reporters_mutex_);
        for (const auto& r : reporters_) where += "; this rank is " + r.second();
        return where;
    }

    std::string who_;
    std::chrono::milliseconds timeout_;

    std::mutex mutex_;  // the running collective and the departed peers
    CollectiveCall current_;
    std::uint64_t last_completed_ = 0;
    Clock::time_point deadline_;
    bool busy_ = false;
    std::vector<Departure> departed_;

    std::mutex reporters_mutex_;
    std::vector<std::pair<std::uint64_t, std::function<std::string()>>> reporters_;
    std::uint64_t next_reporter_ = 0;
};

}  // namespace gradsync::inline v0::detail
