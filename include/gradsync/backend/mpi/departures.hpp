// PeerDepartures: how a rank learns at once that a peer has left the group. A rank whose
// MpiBackend is destroyed sends every peer a farewell naming the last collective it completed,
// then waits (up to a deadline) for every peer's farewell, so that no message is left
// unreceived when the communicator is freed (its context could be reused by a later one). While
// the backend lives, its watcher polls for farewells: a collective that needs a rank that has
// left can never complete, and the rank learns it now instead of at its deadline.
#pragma once

#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/error.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace gradsync::inline v0::detail {

struct Departure {
    int rank = -1;
    std::uint64_t last_completed = 0;  // the number of the last collective it completed
    bool unwinding = false;            // it left while an exception propagated

    [[nodiscard]] std::string describe() const {
        return "rank " + std::to_string(rank) + " has left the group (destroyed its MpiBackend" +
               (unwinding ? " while an exception propagated" : "") + ") after its collective #" +
               std::to_string(last_completed);
    }
};

class PeerDepartures {
public:
    // Collective over `comm`: every rank creates one, in the same order as its other
    // communicators, whatever its options.
    explicit PeerDepartures(MPI_Comm comm) {
        const int rc = MPI_Comm_dup(comm, &comm_);
        if (rc != MPI_SUCCESS) throw CollectiveError("gradsync: MPI_Comm_dup failed: " + mpi_error_string(rc));
        MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
        MPI_Comm_rank(comm_, &rank_);
        MPI_Comm_size(comm_, &size_);
        gone_.assign(static_cast<std::size_t>(size_), false);
        gone_[static_cast<std::size_t>(rank_)] = true;
        post();
    }
    PeerDepartures(const PeerDepartures&) = delete;
    PeerDepartures& operator=(const PeerDepartures&) = delete;
    ~PeerDepartures() {
        if (pending_ != MPI_REQUEST_NULL) {
            MPI_Cancel(&pending_);
            MPI_Wait(&pending_, MPI_STATUS_IGNORE);
        }
        MPI_Comm_free(&comm_);
    }

    // The farewells that arrived since the last call. One thread at a time.
    std::vector<Departure> poll() {
        std::vector<Departure> arrived;
        while (pending_ != MPI_REQUEST_NULL) {
            int done = 0;
            MPI_Status status{};
            if (MPI_Test(&pending_, &done, &status) != MPI_SUCCESS || !done) break;
            const auto from = static_cast<std::size_t>(status.MPI_SOURCE);
            if (from < gone_.size() && !gone_[from]) {
                gone_[from] = true;
                arrived.push_back({status.MPI_SOURCE, message_[0], message_[1] != 0});
            }
            post();
        }
        return arrived;
    }

    // Tells every peer that this rank leaves after collective #`last_completed`, and waits until
    // each has left too or `deadline` passes. Returns the ranks that had not left by then.
    std::vector<int> leave(std::uint64_t last_completed, bool unwinding,
                           std::chrono::steady_clock::time_point deadline) {
        const std::uint64_t farewell[2] = {last_completed, unwinding ? 1u : 0u};
        std::vector<MPI_Request> sent;
        for (int peer = 0; peer < size_; ++peer) {
            if (peer == rank_) continue;
            MPI_Request request = MPI_REQUEST_NULL;
            if (MPI_Isend(farewell, 2, MPI_UINT64_T, peer, tag, comm_, &request) == MPI_SUCCESS)
                sent.push_back(request);
        }
        while (!all_gone() && std::chrono::steady_clock::now() < deadline) {
            poll();
            if (!all_gone()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        for (auto& request : sent) {
            int done = 0;
            while (MPI_Test(&request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done &&
                   std::chrono::steady_clock::now() < deadline)
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            if (!done && request != MPI_REQUEST_NULL) MPI_Request_free(&request);
        }
        std::vector<int> staying;
        for (int peer = 0; peer < size_; ++peer)
            if (!gone_[static_cast<std::size_t>(peer)]) staying.push_back(peer);
        return staying;
    }

private:
    static constexpr int tag = 0x6779;

    [[nodiscard]] bool all_gone() const {
        for (const bool gone : gone_)
            if (!gone) return false;
        return true;
    }

    void post() {
        pending_ = MPI_REQUEST_NULL;
        if (all_gone()) return;
        MPI_Irecv(message_, 2, MPI_UINT64_T, MPI_ANY_SOURCE, tag, comm_, &pending_);
    }

    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0;
    int size_ = 1;
    std::vector<bool> gone_;  // by rank: has said farewell (this rank counts as gone)
    MPI_Request pending_ = MPI_REQUEST_NULL;
    std::uint64_t message_[2] = {};
};

}  // namespace gradsync::inline v0::detail
