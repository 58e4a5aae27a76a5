// How one rank's NcclBackend gets its communicator: made (ncclCommInitRankConfig from a unique
// id) or split from another's (ncclCommSplit), non-blocking either way, then polled until every
// rank has joined, by the deadline; and, for a split, which of the parent's ranks each group
// holds, agreed before NCCL is asked. Needs <nccl.h> and the CUDA runtime.
#pragma once

#include <gradsync/backend/group_label.hpp>
#include <gradsync/backend/nccl/algorithm.hpp>
#include <gradsync/backend/nccl/communicator.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/error.hpp>

#include <nccl.h>

#include <algorithm>  // for std::stable_sort
#include <chrono>
#include <string>
#include <thread>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0::detail {

inline CollectiveError nccl_join_error(const NcclCommunicator& s, ncclResult_t r) {
    std::string hint;
    if (r == ncclInvalidUsage)
        hint =
            ". If two ranks were given the same GPU: start one rank per GPU, each with its own LOCAL_RANK, "
            "or each with CUDA_VISIBLE_DEVICES naming a different GPU";
    return CollectiveError(
        s.who + ": joining the NCCL communicator failed: " + nccl_words(r, s.comm_alive ? s.comm : nullptr) + hint);
}

// `make(config)` starts the communicator into s.comm; this waits, by s.timeout, until every rank
// has joined. Inside the watchdog's gate: an abort (abort(), the stop token) ends the wait at its
// next poll. `late` says why the ranks may not all have come.
template <class Make>
void nccl_join(NcclCommunicator& s, const char* algo, Make&& make, const std::string& late) {
    s.watchdog->run([&] {
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;  // every call returns at once; we poll, with a deadline
        // NCCL reads NCCL_ALGO while it initializes the communicator: set from here until every
        // rank has joined, no longer.
        ScopedNcclAlgo scoped(algo);
        ncclResult_t r = make(&config);
        if (r != ncclSuccess && r != ncclInProgress) throw nccl_join_error(s, r);
        s.comm_alive = true;
        const auto deadline = deadline_after(s.timeout);
        for (;;) {
            ncclResult_t state = ncclSuccess;
            r = ncclCommGetAsyncError(s.comm, &state);
            if (r != ncclSuccess) state = r;
            if (state == ncclSuccess) return;
            if (state != ncclInProgress) {
                auto error = nccl_join_error(s, state);
                s.abort_comm();
                throw error;
            }
            s.watchdog->rethrow_if_failed();  // aborted meanwhile: the gate aborts as this returns
            if (std::chrono::steady_clock::now() >= deadline) {
                s.abort_comm();
                throw TimeoutError(s.who + ": the ranks did not all join the NCCL communicator within " +
                                   std::to_string(s.timeout.count()) + " ms; " + late);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
    });
}

// One rank's place in the group a split gives it.
struct NcclSplitPlace {
    int rank = 0, size = 1;
    GroupLabel label;
};

// From every parent rank's colour and key (in parent rank order): the parent ranks of `colour`,
// ordered by key, then by parent rank as NCCL orders them; named by `parent`'s own job ranks.
inline NcclSplitPlace nccl_split_place(const std::vector<double>& colours, const std::vector<double>& keys,
                                       int parent_rank, const GroupLabel& parent, std::string name) {
    const double mine = colours[static_cast<std::size_t>(parent_rank)];
    std::vector<int> members;
    for (std::size_t r = 0; r < colours.size(); ++r)
        if (colours[r] == mine) members.push_back(static_cast<int>(r));
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
        return keys[static_cast<std::size_t>(a)] < keys[static_cast<std::size_t>(b)];
    });
    NcclSplitPlace place;
    place.size = static_cast<int>(members.size());
    for (std::size_t i = 0; i < members.size(); ++i)
        if (members[i] == parent_rank) place.rank = static_cast<int>(i);
    // The parent's ranks as the job's: through the parent's own group where it is one.
    int job_size = static_cast<int>(colours.size());
    if (!parent.whole_job()) {
        for (auto& m : members) m = parent.world_ranks[static_cast<std::size_t>(m)];
        job_size = -1;  // a group of a group is never the whole job
    }
    place.label = group_label(std::move(name), std::move(members), job_size);
    return place;
}

}  // namespace gradsync::inline v0::detail
