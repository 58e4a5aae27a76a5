// One process per GPU, from the launcher's variables: which rank this is (process_place():
// torchrun's RANK/WORLD_SIZE/LOCAL_RANK, paddle.distributed.launch's PADDLE_TRAINER_ID and the
// rest, or Open MPI's, PMI's, Slurm's), which GPU it drives (the one paddle.distributed.launch
// chose in FLAGS_selected_gpus, else LOCAL_RANK among the visible ones, or the one GPU a rank
// sees when CUDA_VISIBLE_DEVICES gives each rank its own), and NCCL's unique id,
// made the same on every rank without any exchange by NCCL's own mechanism: NCCL_COMM_ID names
// the address rank 0's NCCL listens on, and every rank derives the id from it. Not included by
// <gradsync/gradsync.hpp>: needs <nccl.h> and the CUDA runtime.
#pragma once

#include <gradsync/cuda/check.hpp>
#include <gradsync/environment.hpp>
#include <gradsync/error.hpp>

#include <nccl.h>

#include <algorithm>  // for std::min
#include <cstddef>
#include <cstdlib>  // for setenv
#include <string>

namespace gradsync::inline v0 {

struct NcclPlace {
    ProcessPlace place;
    int device = 0;        // the CUDA device this rank drives
    std::string comm_id;   // NCCL_COMM_ID: where rank 0's NCCL listens; empty for a world of one
    ncclUniqueId id = {};  // the same on every rank
};

namespace detail {

// NCCL_COMM_ID when the user set it; else MASTER_ADDR and MASTER_PORT + 1, because torchrun's own
// store already listens on MASTER_PORT; else the endpoint paddle.distributed.launch reserved for
// rank 0 (the first of PADDLE_TRAINER_ENDPOINTS).
inline std::string nccl_comm_id(EnvLookup lookup, const ProcessPlace& place) {
    if (auto given = lookup("NCCL_COMM_ID")) return *given;
    if (!lookup("MASTER_ADDR") && !lookup("MASTER_PORT")) {
        if (auto endpoints = lookup("PADDLE_TRAINER_ENDPOINTS")) {
            const auto first = endpoints->substr(0, endpoints->find(','));
            if (first.find(':') == std::string::npos || first.back() == ':')
                throw Error("gradsync: PADDLE_TRAINER_ENDPOINTS='" + *endpoints +
                            "' does not begin with an address:port for rank 0");
            return first;
        }
    }
    auto addr = lookup("MASTER_ADDR");
    auto port = lookup("MASTER_PORT");
    if (addr && port) {
        const int p = parse_count("MASTER_PORT", *port);
        if (p < 1 || p > 65534)
            throw Error("gradsync: MASTER_PORT=" + *port + " is not a port from 1 to 65534 (NCCL listens on the next)");
        return *addr + ":" + std::to_string(p + 1);
    }
    if (place.world_size == 1) return "";
    throw Error(rank_prefix(place.rank, place.world_size, place.source) +
                " has no address to meet the other ranks at: set MASTER_ADDR and MASTER_PORT (torchrun does; NCCL "
                "listens on MASTER_PORT + 1), or NCCL_COMM_ID=host:port");
}

// `device_count` and `why_none` as cuda_devices() tells them; `lookup` reads the environment.
inline NcclPlace nccl_place_from(EnvLookup lookup, int device_count, const std::string& why_none) {
    NcclPlace p;
    p.place = place_from(lookup);
    const std::string who = rank_prefix(p.place.rank, p.place.world_size, p.place.source);
    if (device_count == 0) throw Error(who + " needs a CUDA device: " + why_none);
    // The GPU paddle.distributed.launch chose; else LOCAL_RANK among the visible GPUs; or, where
    // every rank sees one GPU of its own through CUDA_VISIBLE_DEVICES (as Slurm's
    // --gpus-per-task=1 sets it), that one.
    const auto visible = lookup("CUDA_VISIBLE_DEVICES");
    if (auto selected = lookup("FLAGS_selected_gpus")) {  // paddle.distributed.launch --gpus
        p.device = parse_count("FLAGS_selected_gpus", *selected);
        if (visible) {  // a GPU that CUDA_VISIBLE_DEVICES lists is numbered by its place there
            std::size_t begin = 0;
            for (int index = 0; begin <= visible->size(); ++index) {
                const auto end = std::min(visible->find(',', begin), visible->size());
                if (visible->substr(begin, end - begin) == *selected) {
                    p.device = index;
                    break;
                }
                begin = end + 1;
            }
        }
        if (p.device >= device_count)
            throw Error(who + ": FLAGS_selected_gpus=" + *selected + ", but this process sees " +
                        std::to_string(device_count) + " CUDA device" + (device_count == 1 ? "" : "s"));
    } else if (p.place.local_world_size <= device_count) {
        p.device = p.place.local_rank;
    } else if (visible && device_count == 1) {
        p.device = 0;
    } else {
        throw Error(who + ": " + std::to_string(p.place.local_world_size) + " ranks on this machine but " +
                    std::to_string(device_count) + " CUDA device" + (device_count == 1 ? "" : "s") + " visible" +
                    (visible ? " (CUDA_VISIBLE_DEVICES=" + *visible + ")" : "") +
                    ": ranks would share a GPU, which NCCL does not allow. Start one rank per GPU, or give each "
                    "rank its own GPU through CUDA_VISIBLE_DEVICES.");
    }
    p.comm_id = nccl_comm_id(lookup, p.place);
    // NCCL reads NCCL_COMM_ID from the process environment, here and in rank 0's ncclCommInitRank.
    if (!p.comm_id.empty() && ::setenv("NCCL_COMM_ID", p.comm_id.c_str(), 1) != 0)
        throw Error(who + ": cannot set NCCL_COMM_ID");
    const ncclResult_t result = ncclGetUniqueId(&p.id);
    if (result != ncclSuccess) {
        const char* why = ncclGetLastError(nullptr);
        throw CollectiveError(who + ": ncclGetUniqueId failed: " + ncclGetErrorString(result) +
                              (why != nullptr && *why != '\0' ? std::string(" (") + why + ")" : std::string()) +
                              (p.comm_id.empty() ? "" : "; NCCL_COMM_ID=" + p.comm_id));
    }
    return p;
}

}  // namespace detail

// This process's rank, GPU and NCCL unique id, from the environment; throws, naming the variable,
// when they are missing or inconsistent, when there is no GPU, or when this machine has more
// ranks than GPUs. Sets NCCL_COMM_ID (from MASTER_ADDR/MASTER_PORT) for NCCL to read. The caller
// then selects the device and calls ncclCommInitRank(&comm, place.world_size, id, place.rank).
inline NcclPlace nccl_place_from_environment() {
    const auto devices = cuda_devices();
    return detail::nccl_place_from(detail::real_env, devices.count, devices.why);
}

}  // namespace gradsync::inline v0
