// PeerStandings: how a rank whose collective is late learns where its peers stand, so that its last
// words name the culprit. It asks every peer over a communicator of its own; each peer's watcher
// answers between its other checks with its own words (collectives completed, the one it waits
// in, what its status reporters say: the step, the bucket or parameter it waits for). A stopped
// process does not answer, which names it too. Needs MPI_THREAD_MULTIPLE (the watcher's thread
// calls MPI while a collective runs on another).
#pragma once

#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::max
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>  // for std::function
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace gradsync::inline v0::detail {

class PeerStandings {
public:
    // Collective over `comm`: every rank creates one, in the same order as its other
    // communicators, whatever its options.
    explicit PeerStandings(MPI_Comm comm) {
        const int rc = MPI_Comm_dup(comm, &comm_);
        if (rc != MPI_SUCCESS) throw CollectiveError("gradsync: MPI_Comm_dup failed: " + mpi_error_string(rc));
        MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
        MPI_Comm_rank(comm_, &rank_);
        MPI_Comm_size(comm_, &size_);
        post();
    }
    PeerStandings(const PeerStandings&) = delete;
    PeerStandings& operator=(const PeerStandings&) = delete;
    ~PeerStandings() {
        if (asked_ != MPI_REQUEST_NULL) {
            MPI_Cancel(&asked_);
            MPI_Wait(&asked_, MPI_STATUS_IGNORE);
        }
        for (auto& reply : replies_)  // only after a failure: a peer that asked and left
            if (reply.request != MPI_REQUEST_NULL) MPI_Request_free(&reply.request);
        MPI_Comm_free(&comm_);
    }

    // Answers every question that has arrived with `words()`.
    void serve(const std::function<std::string()>& words) {
        std::lock_guard lock(mutex_);
        serve_locked(words);
    }

    // Asks every peer where it stands and waits up to `wait` for the answers, answering peers
    // that ask meanwhile with `words()`. By rank: the answer, or none (no answer in time; this
    // rank's own entry is none too).
    std::vector<std::optional<std::string>> ask(std::chrono::milliseconds wait,
                                                const std::function<std::string()>& words) {
        std::lock_guard lock(mutex_);
        return ask_locked(wait, words);
    }

private:
    static constexpr int ask_tag = 0x6773, answer_tag = 0x6774;

    struct Reply {
        std::string text;
        MPI_Request request = MPI_REQUEST_NULL;
    };

    void serve_locked(const std::function<std::string()>& words) {
        for (auto it = replies_.begin(); it != replies_.end();) {  // sent answers done with
            int done = 0;
            if (MPI_Test(&it->request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done)
                it = replies_.erase(it);
            else
                ++it;
        }
        while (asked_ != MPI_REQUEST_NULL) {
            int done = 0;
            MPI_Status status{};
            if (MPI_Test(&asked_, &done, &status) != MPI_SUCCESS || !done) break;
            auto& reply = replies_.emplace_back();
            reply.text = words();
            if (MPI_Isend(reply.text.data(), static_cast<int>(reply.text.size()), MPI_CHAR, status.MPI_SOURCE,
                          answer_tag, comm_, &reply.request) != MPI_SUCCESS)
                replies_.pop_back();
            post();
        }
    }

    std::vector<std::optional<std::string>> ask_locked(std::chrono::milliseconds wait,
                                                       const std::function<std::string()>& words) {
        std::vector<std::optional<std::string>> answers(static_cast<std::size_t>(size_));
        std::vector<MPI_Request> sent;
        for (int peer = 0; peer < size_; ++peer) {
            if (peer == rank_) continue;
            MPI_Request request = MPI_REQUEST_NULL;
            if (MPI_Isend(&question_sent_, 1, MPI_CHAR, peer, ask_tag, comm_, &request) == MPI_SUCCESS)
                sent.push_back(request);
        }
        int missing = size_ - 1;
        const auto deadline = std::chrono::steady_clock::now() + wait;
        while (missing > 0 && std::chrono::steady_clock::now() < deadline) {
            serve_locked(words);
            int arrived = 0;
            MPI_Status status{};
            if (MPI_Iprobe(MPI_ANY_SOURCE, answer_tag, comm_, &arrived, &status) != MPI_SUCCESS) break;
            if (!arrived) {
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
                continue;
            }
            int length = 0;
            MPI_Get_count(&status, MPI_CHAR, &length);
            std::string text(static_cast<std::size_t>(length > 0 ? length : 0), '\0');
            MPI_Recv(text.data(), length, MPI_CHAR, status.MPI_SOURCE, answer_tag, comm_, MPI_STATUS_IGNORE);
            auto& slot = answers[static_cast<std::size_t>(status.MPI_SOURCE)];
            if (!slot) --missing;
            slot = std::move(text);
        }
        for (auto& request : sent) {  // a question to a stopped peer may never be taken
            int done = 0;
            if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && request != MPI_REQUEST_NULL)
                MPI_Request_free(&request);
        }
        return answers;
    }

    void post() {
        asked_ = MPI_REQUEST_NULL;
        MPI_Irecv(&question_, 1, MPI_CHAR, MPI_ANY_SOURCE, ask_tag, comm_, &asked_);
    }

    std::mutex mutex_;  // the watcher serves, a late rank's thread may ask
    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0;
    int size_ = 1;
    MPI_Request asked_ = MPI_REQUEST_NULL;  // the next question, from any peer
    char question_ = 0;
    char question_sent_ = '?';  // a member: a send to a stopped peer may outlive ask()
    std::list<Reply> replies_;  // answers being sent (a list: their buffers must not move)
};

// A rank's answer: the collectives it has completed, whether it waits in one, and its words.
struct Standing {
    std::uint64_t completed = 0;
    bool in_collective = false;
    std::string words;

    [[nodiscard]] std::string text() const {
        return std::to_string(completed) + " " + (in_collective ? "1" : "0") + " " + words;
    }
    static std::optional<Standing> from_text(const std::string& text) {
        Standing out;
        const auto space = text.find(' ');
        if (space == std::string::npos || space + 1 >= text.size()) return std::nullopt;
        try {
            out.completed = std::stoull(text.substr(0, space));
        } catch (const std::exception&) {
            return std::nullopt;
        }
        out.in_collective = text[space + 1] == '1';
        out.words = space + 3 <= text.size() ? text.substr(space + 3) : std::string();
        return out;
    }
};

// The peers' answers as the late rank's last words: where each stands, and which ranks are
// behind (entered fewer collectives than the furthest, counting the one each waits in; or gave
// no answer).
inline std::string where_peers_stand(const std::vector<std::optional<std::string>>& answers, int rank,
                                     const Standing& mine, std::chrono::milliseconds wait) {
    const auto entered = [](const Standing& s) { return s.completed + (s.in_collective ? 1 : 0); };
    std::uint64_t furthest = entered(mine);
    std::vector<std::optional<Standing>> standings(answers.size());
    for (std::size_t r = 0; r < answers.size(); ++r) {
        if (static_cast<int>(r) == rank || !answers[r]) continue;
        standings[r] = Standing::from_text(*answers[r]);
        if (standings[r]) furthest = std::max(furthest, entered(*standings[r]));
    }
    std::string out = " Where the peers stand:", behind;
    for (std::size_t r = 0; r < answers.size(); ++r) {
        if (static_cast<int>(r) == rank) continue;
        const auto who = "rank " + std::to_string(r);
        out += (out.back() == ':' ? " " : "; ") + who;
        const auto& s = standings[r];
        if (!s) {
            out += " did not answer within " + std::to_string(wait.count()) +
                   " ms (stopped, cut off from this rank, or busy outside gradsync with its watcher unable to run)";
            behind += (behind.empty() ? "" : ", ") + who;
            continue;
        }
        out += " has completed " + std::to_string(s->completed) + " collectives" +
               (s->in_collective ? "" : " and is in none") + (s->words.empty() ? "" : ": " + s->words);
        if (entered(*s) < furthest) behind += (behind.empty() ? "" : ", ") + who;
    }
    if (!behind.empty()) out += ". Behind: " + behind;
    return out + ".";
}

}  // namespace gradsync::inline v0::detail
