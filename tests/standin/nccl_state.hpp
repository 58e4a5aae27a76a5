// The stand-in NCCL's communicators and cliques, shared by its communicator functions
// (nccl_comms.cpp) and its collectives (nccl_collectives.cpp).
#pragma once

#include "device_state.hpp"
#include "nccl_reduce.hpp"

#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace standin::detail {
struct Clique;
}  // namespace standin::detail

// NCCL's opaque communicator, completed here: a handle is the address of one of these.
struct ncclComm {
    std::shared_ptr<standin::detail::Clique> clique;
    int rank = 0, size = 1, device = 0;
    bool blocking = true;
    std::atomic<bool> aborted{false};
    std::mutex mutex;  // what follows
    bool joining = true, finalizing = false;
    int in_progress_left = 0;
    ncclResult_t injected = ncclSuccess;
    std::string last_error;
    std::uint64_t issued = 0, completed = 0;
    std::uint64_t splits = 0;      // ncclCommSplit calls
    std::map<int, double> premul;  // pre-multiplied sums' factors, by operator
    int next_op = ncclNumOps;
};

namespace standin::detail {

// One collective's parts as the ranks' streams reach it.
struct CliqueOp {
    std::vector<std::optional<NcclPart>> parts;
    int arrived = 0, left = 0;
    bool done = false;
};

// One ncclCommSplit as the ranks reach it: each rank's colour, key, device and blocking mode,
// then each rank's new communicator.
struct SplitRound {
    struct Arrival {
        int color = 0, key = 0, device = 0;
        bool blocking = true;
    };
    std::vector<std::optional<Arrival>> arrivals;
    std::vector<std::shared_ptr<ncclComm>> made;
    int arrived = 0, left = 0;
    bool done = false;
};

struct Clique {
    explicit Clique(int n) : size(n), members(std::size_t(n), nullptr) {}
    const int size;
    std::mutex mutex;
    std::condition_variable changed;
    std::vector<ncclComm*> members;
    int joined = 0;
    std::map<std::uint64_t, CliqueOp> ops;
    std::map<std::uint64_t, SplitRound> splits;
    ncclResult_t broken = ncclSuccess;  // not success: every member fails with it
    std::string why;
};

struct NcclRegistry {
    std::mutex mutex;
    std::map<std::string, std::weak_ptr<Clique>> joining;  // by unique id, until full
    // Ids from ncclGetUniqueId whose communicator is made: NCCL's root for such an id serves one
    // initialization and is gone after it (an id from NCCL_COMM_ID is made anew each time).
    std::set<std::string> spent;
    std::map<ncclComm*, std::shared_ptr<ncclComm>> comms;
    int in_progress_polls = 1;
};

NcclRegistry& nccl_registry();
std::string& thread_last_error();  // ncclGetLastError(nullptr)

// The communicator behind a handle; null for one NCCL does not know (destroyed, aborted).
std::shared_ptr<ncclComm> find_comm(ncclComm_t comm);

// Fails a call: its words become the last error (of `comm`, and of this thread); a misuse is
// also reported.
ncclResult_t refuse(ncclComm* comm, ncclResult_t code, std::string why, bool is_misuse = true);

// What ncclCommGetAsyncError says of `c` now.
ncclResult_t state_of(ncclComm& c);

// The answer to a call that queued work: in progress for a while on a non-blocking communicator.
ncclResult_t queued(ncclComm& c);

}  // namespace standin::detail
