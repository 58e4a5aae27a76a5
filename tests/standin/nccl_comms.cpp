// The stand-in NCCL's communicators: unique ids, joining (a clique per id), splitting,
// finalizing, destroying and aborting, their errors, and the test-facing NCCL controls of
// standin.hpp. A non-blocking communicator answers ncclInProgress while it joins and while it
// finalizes. Collectives: nccl_collectives.cpp.
#include "nccl_state.hpp"
#include "standin.hpp"

#include <algorithm>  // for std::min, std::stable_sort
#include <chrono>
#include <cstdlib>  // for std::getenv
#include <cstring>
#include <random>
#include <thread>
#include <utility>  // for std::move

using standin::detail::Clique;
using standin::detail::find_comm;
using standin::detail::nccl_registry;
using standin::detail::refuse;
using standin::detail::report_misuse;
using standin::detail::SplitRound;
using standin::detail::state_of;

namespace standin::detail {

std::string& thread_last_error() {
    thread_local std::string words;
    return words;
}

NcclRegistry& nccl_registry() {
    static auto* r = new NcclRegistry;  // never destroyed: stream threads may outlive main
    return *r;
}

std::shared_ptr<ncclComm> find_comm(ncclComm_t comm) {
    auto& r = nccl_registry();
    std::lock_guard lock(r.mutex);
    const auto it = r.comms.find(comm);
    return it == r.comms.end() ? nullptr : it->second;
}

ncclResult_t refuse(ncclComm* comm, ncclResult_t code, std::string why, bool is_misuse) {
    if (is_misuse) report_misuse(why);
    if (comm != nullptr) {
        std::lock_guard lock(comm->mutex);
        comm->last_error = why;
    }
    standin::detail::thread_last_error() = std::move(why);
    return code;
}

// What ncclCommGetAsyncError says of `c` now.
ncclResult_t state_of(ncclComm& c) {
    auto& clique = *c.clique;
    bool all_joined = false;
    ncclResult_t broken = ncclSuccess;
    std::string why;
    {
        std::lock_guard lock(clique.mutex);
        all_joined = clique.joined == clique.size;
        broken = clique.broken;
        why = clique.why;
    }
    std::lock_guard lock(c.mutex);
    if (c.injected != ncclSuccess) return c.injected;
    if (broken != ncclSuccess) {
        c.last_error = why;
        return broken;
    }
    if (c.joining) {
        if (!all_joined) return ncclInProgress;
        c.joining = false;
    }
    if (c.in_progress_left > 0) {
        --c.in_progress_left;
        return ncclInProgress;
    }
    if (c.finalizing && c.completed < c.issued) return ncclInProgress;
    return ncclSuccess;
}

// The answer to a call that queued work: in progress for a while on a non-blocking communicator.
ncclResult_t queued(ncclComm& c) {
    if (c.blocking) return ncclSuccess;
    const int polls = [] {
        auto& r = nccl_registry();
        std::lock_guard lock(r.mutex);
        return r.in_progress_polls;
    }();
    if (polls == 0) return ncclSuccess;
    std::lock_guard lock(c.mutex);
    c.in_progress_left = polls;
    return ncclInProgress;
}

}  // namespace standin::detail

namespace {
std::string id_key(const ncclUniqueId& id) { return std::string(id.internal, sizeof id.internal); }
}  // namespace

namespace standin {

void nccl_inject_error(ncclComm_t comm, ncclResult_t error, std::string why) {
    auto c = find_comm(comm);
    if (!c) return;
    std::lock_guard lock(c->mutex);
    c->injected = error;
    c->last_error = std::move(why);
}

void nccl_set_in_progress_polls(int polls) {
    auto& r = nccl_registry();
    std::lock_guard lock(r.mutex);
    r.in_progress_polls = polls;
}

std::uint64_t nccl_calls(ncclComm_t comm) {
    auto c = find_comm(comm);
    if (!c) return 0;
    std::lock_guard lock(c->mutex);
    return c->issued;
}

int nccl_parts_waiting(ncclComm_t comm) {
    auto c = find_comm(comm);
    if (!c) return 0;
    std::lock_guard lock(c->clique->mutex);
    int waiting = 0;
    for (const auto& [seq, op] : c->clique->ops)
        if (!op.done && op.parts[std::size_t(c->rank)]) ++waiting;
    return waiting;
}

}  // namespace standin
ncclResult_t ncclGetVersion(int* version) {
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    *id = ncclUniqueId{};
    std::string key;
    // With NCCL_COMM_ID every rank derives the same id from the address rank 0 listens on.
    if (const char* at = std::getenv("NCCL_COMM_ID"); at != nullptr && *at != '\0') {
        const std::string address = at;
        const auto colon = address.rfind(':');
        const bool port = colon != std::string::npos && colon + 1 < address.size() &&
                          address.find_first_not_of("0123456789", colon + 1) == std::string::npos;
        if (colon == 0 || !port)
            return refuse(nullptr, ncclInvalidArgument,
                          "Invalid NCCL_COMM_ID [" + address +
                              "], please use format: <ipv4>:<port> or [<ipv6>]:<port> or <hostname>:<port>",
                          false);
        key = "address " + address;
    } else {
        static std::atomic<std::uint64_t> made{0};
        thread_local std::mt19937_64 random{std::random_device{}()};
        key = "id " + std::to_string(++made) + " " + std::to_string(random());
    }
    std::memcpy(id->internal, key.data(), std::min(key.size(), sizeof id->internal));
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
    *out = nullptr;
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return refuse(nullptr, ncclInvalidArgument,
                      "ncclCommInitRank: rank " + std::to_string(rank) + " of " + std::to_string(nranks), false);
    auto comm = std::make_shared<ncclComm>();
    comm->rank = rank;
    comm->size = nranks;
    comm->device = standin::detail::device_for_call("ncclCommInitRank");
    comm->blocking = config == nullptr || config->blocking != 0;
    auto& r = nccl_registry();
    std::shared_ptr<Clique> clique;
    {
        std::lock_guard lock(r.mutex);
        if (r.spent.contains(id_key(id)))
            return refuse(nullptr, ncclRemoteError,
                          "ncclCommInitRank: this unique id's communicator was made already, and an id from "
                          "ncclGetUniqueId serves one initialization (NCCL fails it after its connection retries: "
                          "remote process exited or there was a network error, connection refused)",
                          true);
        auto& slot = r.joining[id_key(id)];
        clique = slot.lock();
        if (!clique) {
            clique = std::make_shared<Clique>(nranks);
            slot = clique;
        }
        std::lock_guard clique_lock(clique->mutex);
        if (clique->size != nranks)
            return refuse(nullptr, ncclInvalidArgument,
                          "ncclCommInitRank: " + std::to_string(nranks) + " ranks, but another rank of this id said " +
                              std::to_string(clique->size),
                          false);
        if (clique->members[std::size_t(rank)] != nullptr)
            return refuse(nullptr, ncclInvalidArgument,
                          "ncclCommInitRank: rank " + std::to_string(rank) + " joined twice", false);
        for (int other = 0; other < nranks; ++other) {
            const ncclComm* m = clique->members[std::size_t(other)];
            if (m != nullptr && m->device == comm->device && clique->broken == ncclSuccess) {
                clique->broken = ncclInvalidUsage;
                clique->why = "Duplicate GPU detected : rank " + std::to_string(other) + " and rank " +
                              std::to_string(rank) + " both on CUDA device " + std::to_string(comm->device);
            }
        }
        clique->members[std::size_t(rank)] = comm.get();
        if (++clique->joined == nranks) {
            r.joining.erase(id_key(id));
            if (id_key(id).starts_with("id ")) r.spent.insert(id_key(id));
        }
        clique->changed.notify_all();
        comm->clique = clique;
        r.comms[comm.get()] = comm;
    }
    *out = comm.get();
    if (!comm->blocking) return ncclInProgress;
    std::unique_lock lock(clique->mutex);
    clique->changed.wait(lock, [&] { return clique->joined == nranks || clique->broken != ncclSuccess; });
    if (clique->broken == ncclSuccess) return ncclSuccess;
    std::lock_guard comm_lock(comm->mutex);
    comm->last_error = clique->why;
    return clique->broken;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

// Blocks until every rank of the parent has called it (or the parent is aborted), whatever the
// configuration asks: the new communicators are joined when it returns.
ncclResult_t ncclCommSplit(ncclComm_t handle, int color, int key, ncclComm_t* out, ncclConfig_t* config) {
    *out = nullptr;
    auto comm = find_comm(handle);
    if (!comm) return refuse(nullptr, ncclInvalidArgument, "ncclCommSplit of a communicator NCCL does not know");
    const int device = standin::detail::device_for_call("ncclCommSplit");
    std::uint64_t seq = 0;
    {
        std::lock_guard lock(comm->mutex);
        seq = ++comm->splits;
    }
    auto& clique = *comm->clique;
    std::unique_lock lock(clique.mutex);
    SplitRound& round = clique.splits[seq];
    if (round.arrivals.empty()) {
        round.arrivals.resize(std::size_t(clique.size));
        round.made.resize(std::size_t(clique.size));
    }
    round.arrivals[std::size_t(comm->rank)] =
        SplitRound::Arrival{color, key, device, config == nullptr || config->blocking != 0};
    if (++round.arrived == clique.size) {
        std::map<int, std::vector<int>> by_color;  // parent ranks, by colour
        for (int r = 0; r < clique.size; ++r)
            if (round.arrivals[std::size_t(r)]->color != NCCL_SPLIT_NOCOLOR)
                by_color[round.arrivals[std::size_t(r)]->color].push_back(r);
        for (auto& [c, ranks] : by_color) {
            std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
                return round.arrivals[std::size_t(a)]->key < round.arrivals[std::size_t(b)]->key;
            });
            auto made = std::make_shared<Clique>(int(ranks.size()));
            made->joined = made->size;
            for (std::size_t i = 0; i < ranks.size(); ++i) {
                const auto& a = *round.arrivals[std::size_t(ranks[i])];
                auto child = std::make_shared<ncclComm>();
                child->clique = made;
                child->rank = int(i);
                child->size = made->size;
                child->device = a.device;
                child->blocking = a.blocking;
                made->members[i] = child.get();
                round.made[std::size_t(ranks[i])] = std::move(child);
            }
        }
        // Registered outside the clique's lock (the registry's is taken first everywhere); the
        // other ranks wait for `done` meanwhile.
        lock.unlock();
        {
            auto& registered = nccl_registry();
            std::lock_guard registry_lock(registered.mutex);
            for (const auto& child : round.made)
                if (child) registered.comms[child.get()] = child;
        }
        lock.lock();
        round.done = true;
        clique.changed.notify_all();
    } else {
        clique.changed.wait(lock, [&] { return round.done || comm->aborted; });
        if (!round.done)
            return refuse(comm.get(), ncclInvalidUsage, "ncclCommSplit: the communicator was aborted", false);
    }
    *out = round.made[std::size_t(comm->rank)].get();
    if (++round.left == clique.size) clique.splits.erase(seq);
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t handle) {
    auto comm = find_comm(handle);
    if (!comm) return refuse(nullptr, ncclInvalidArgument, "ncclCommFinalize on a communicator NCCL does not know");
    {
        std::lock_guard lock(comm->mutex);
        comm->finalizing = true;
    }
    if (!comm->blocking) return ncclInProgress;
    for (;;) {
        const ncclResult_t s = state_of(*comm);
        if (s != ncclInProgress) return s;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
}

ncclResult_t ncclCommDestroy(ncclComm_t handle) {
    auto comm = find_comm(handle);
    if (!comm) return refuse(nullptr, ncclInvalidArgument, "ncclCommDestroy of a communicator NCCL does not know");
    {
        std::lock_guard lock(comm->mutex);
        if (comm->completed < comm->issued)
            report_misuse("ncclCommDestroy with collectives still queued: finalize it first, or abort it");
    }
    auto& r = nccl_registry();
    std::lock_guard lock(r.mutex);
    r.comms.erase(handle);
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t handle) {
    auto comm = find_comm(handle);
    if (!comm) return refuse(nullptr, ncclInvalidArgument, "ncclCommAbort of a communicator NCCL does not know");
    {
        std::lock_guard lock(comm->clique->mutex);
        comm->aborted = true;
        comm->clique->changed.notify_all();  // its parts waiting on streams give up
    }
    auto& r = nccl_registry();
    std::lock_guard lock(r.mutex);
    r.comms.erase(handle);
    return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
        case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
        case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
        case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
        case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
        case ncclRemoteError: return "remote process exited or there was a network error";
        case ncclInProgress: return "NCCL operation in progress";
        default: return "unknown result code";
    }
}

const char* ncclGetLastError(ncclComm_t handle) {
    if (handle == nullptr) return standin::detail::thread_last_error().c_str();
    auto comm = find_comm(handle);
    if (!comm) return standin::detail::thread_last_error().c_str();
    std::lock_guard lock(comm->mutex);
    standin::detail::thread_last_error() = comm->last_error;  // outlives this call, as NCCL's buffer does
    return standin::detail::thread_last_error().c_str();
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t handle, ncclResult_t* async) {
    auto comm = find_comm(handle);
    if (!comm)
        return refuse(nullptr, ncclInvalidArgument, "ncclCommGetAsyncError on a communicator NCCL does not know");
    *async = state_of(*comm);
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t handle, int* count) {
    auto comm = find_comm(handle);
    if (!comm) return ncclInvalidArgument;
    *count = comm->size;
    return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t handle, int* device) {
    auto comm = find_comm(handle);
    if (!comm) return ncclInvalidArgument;
    *device = comm->device;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t handle, int* rank) {
    auto comm = find_comm(handle);
    if (!comm) return ncclInvalidArgument;
    *rank = comm->rank;
    return ncclSuccess;
}
