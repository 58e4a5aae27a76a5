// The stand-in NCCL's collectives: each rank's part is checked (device memory of the
// communicator's device, a stream of that device, a communicator that has joined), queued on the
// caller's stream or held for the group, and, when the stream reaches it, waits there for every
// rank's part; the last to arrive computes everyone's result (nccl_reduce.hpp). A rank that never
// arrives keeps its peers' streams waiting until their communicators are aborted, as NCCL's
// kernels spin. Ranks whose collectives differ break the clique (a misuse). Also the
// pre-multiplied sum operators.
#include "nccl_state.hpp"

#include <cstdint>
#include <string>
#include <utility>  // for std::exchange
#include <vector>

using standin::detail::CliqueOp;
using standin::detail::find_comm;
using standin::detail::NcclKind;
using standin::detail::NcclPart;
using standin::detail::queued;
using standin::detail::refuse;
using standin::detail::report_misuse;

namespace {

// The calls of the group this thread is in (ncclGroupStart), queued at ncclGroupEnd.
struct GroupedCall {
    std::shared_ptr<ncclComm> comm;
    std::shared_ptr<CUstream_st> stream;
    NcclPart part;
    std::uint64_t seq = 0;
};
struct Group {
    int depth = 0;
    std::vector<GroupedCall> calls;
};
Group& group() {
    thread_local Group g;
    return g;
}

// On the stream: this rank's part of collective `seq`; waits for every rank's, or for an abort.
void run_part(const std::shared_ptr<ncclComm>& comm, std::uint64_t seq, const NcclPart& part) {
    auto& clique = *comm->clique;
    {
        std::unique_lock lock(clique.mutex);
        if (!comm->aborted && clique.broken == ncclSuccess) {
            CliqueOp& op = clique.ops[seq];
            if (op.parts.empty()) op.parts.resize(std::size_t(clique.size));
            op.parts[std::size_t(comm->rank)] = part;
            if (++op.arrived == clique.size) {
                std::vector<NcclPart> parts;
                for (const auto& p : op.parts) parts.push_back(*p);
                for (std::size_t r = 1; r < parts.size(); ++r) {
                    if (parts[r].same_as(parts[0])) continue;
                    clique.broken = ncclInvalidUsage;
                    clique.why = "the ranks issued different collectives as call " + std::to_string(seq) + ": rank 0 " +
                                 parts[0].describe() + "; rank " + std::to_string(r) + " " + parts[r].describe();
                    report_misuse(clique.why);
                    break;
                }
                if (clique.broken == ncclSuccess && !standin::detail::nccl_compute(parts)) {
                    clique.broken = ncclInvalidArgument;
                    clique.why = "the stand-in does not model " + parts[0].describe();
                    report_misuse(clique.why);
                }
                op.done = true;
                clique.changed.notify_all();
            } else {
                clique.changed.wait(lock, [&] { return op.done || comm->aborted || clique.broken != ncclSuccess; });
                if (!op.done) {
                    // Leaving unfinished (aborted or broken): take the part back, so that no peer
                    // arriving later reads or writes buffers this rank may free the moment it returns.
                    op.parts[std::size_t(comm->rank)].reset();
                    --op.arrived;
                }
            }
            if (op.done && ++op.left == clique.size) clique.ops.erase(seq);
        }
    }
    std::lock_guard lock(comm->mutex);
    ++comm->completed;
}

// Checks and queues (or groups) one rank's part of a collective.
ncclResult_t issue(const char* call, NcclPart part, ncclComm_t handle, cudaStream_t stream) {
    auto comm = find_comm(handle);
    if (!comm)
        return refuse(nullptr, ncclInvalidArgument,
                      std::string(call) + " on a communicator NCCL does not know (destroyed or aborted?)");
    bool all_joined = false;
    {
        std::lock_guard clique_lock(comm->clique->mutex);
        all_joined = comm->clique->joined == comm->clique->size;
    }
    {
        std::lock_guard lock(comm->mutex);
        // Joined by now if every rank has: the caller just has not polled since.
        if (all_joined) comm->joining = false;
        if (comm->joining) {
            comm->last_error = std::string(call) + " on a communicator that has not finished joining";
            report_misuse(comm->last_error);
            return ncclInvalidUsage;
        }
    }
    auto s = standin::detail::resolve_stream(stream);
    if (!s)
        return refuse(comm.get(), ncclInvalidArgument,
                      std::string(call) + " on a stream the CUDA runtime does not know");
    if (s->device != comm->device)
        return refuse(comm.get(), ncclInvalidArgument,
                      std::string(call) + " on a stream of device " + std::to_string(s->device) +
                          " for a communicator of device " + std::to_string(comm->device));
    const std::size_t elem = standin::detail::nccl_type_size(part.type);
    if (elem == 0)
        return refuse(comm.get(), ncclInvalidArgument, std::string(call) + ": a data type the stand-in does not know");
    if (part.kind != NcclKind::allreduce && part.kind != NcclKind::reduce && part.op >= ncclNumOps &&
        part.kind != NcclKind::reduce_scatter)
        part.op = ncclSum;
    if (part.op >= ncclNumOps) {
        std::lock_guard lock(comm->mutex);
        const auto it = comm->premul.find(int(part.op));
        if (it == comm->premul.end()) {
            comm->last_error = std::string(call) + " with a reduction operator this communicator did not create";
            report_misuse(comm->last_error);
            return ncclInvalidArgument;
        }
        part.premul = it->second;
    }
    const int n = comm->size;
    std::size_t send_count = part.count, recv_count = part.count;
    if (part.kind == NcclKind::reduce_scatter) send_count = part.count * std::size_t(n);
    if (part.kind == NcclKind::all_gather) recv_count = part.count * std::size_t(n);
    const bool reads = part.kind != NcclKind::broadcast || comm->rank == part.root;
    const bool writes = part.kind != NcclKind::reduce || comm->rank == part.root;
    auto check_memory = [&](const void* p, std::size_t count, const char* which) -> std::string {
        if (count == 0) return {};
        const auto a = standin::detail::find_allocation(p);
        const std::string where = std::string(call) + "'s " + which + " buffer";
        if (!a || a->kind != standin::detail::MemoryKind::device)
            return where + " lies in host memory, not on the device";
        if (a->device != comm->device)
            return where + " lies on device " + std::to_string(a->device) + ", the communicator's is device " +
                   std::to_string(comm->device);
        if (reinterpret_cast<std::uintptr_t>(p) + count * elem > a->begin + a->size)
            return where + " runs past its allocation";
        return {};
    };
    for (auto problem : {reads ? check_memory(part.send, send_count, "send") : std::string(),
                         writes ? check_memory(part.recv, recv_count, "receive") : std::string()})
        if (!problem.empty()) return refuse(comm.get(), ncclInvalidArgument, problem);
    std::uint64_t seq = 0;
    {
        std::lock_guard lock(comm->mutex);
        seq = ++comm->issued;
    }
    if (group().depth > 0) {
        group().calls.push_back(GroupedCall{comm, s, part, seq});
        return ncclSuccess;
    }
    standin::detail::enqueue(*s, [comm, seq, part] { run_part(comm, seq, part); });
    return queued(*comm);
}

NcclPart part_of(NcclKind kind, const void* send, void* recv, std::size_t count, ncclDataType_t type,
                 ncclRedOp_t op = ncclSum, int root = 0) {
    NcclPart p;
    p.kind = kind;
    p.send = send;
    p.recv = recv;
    p.count = count;
    p.type = type;
    p.op = op;
    p.root = root;
    return p;
}

}  // namespace

ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t type, ncclScalarResidence_t,
                                      ncclComm_t handle) {
    auto comm = find_comm(handle);
    if (!comm)
        return refuse(nullptr, ncclInvalidArgument, "ncclRedOpCreatePreMulSum on a communicator NCCL does not know");
    double value = 0;
    switch (type) {
        case ncclFloat32: value = *static_cast<const float*>(scalar); break;
        case ncclFloat64: value = *static_cast<const double*>(scalar); break;
        case ncclFloat16: value = static_cast<float>(*static_cast<const gradsync::float16*>(scalar)); break;
        case ncclBfloat16: value = static_cast<float>(*static_cast<const gradsync::bfloat16*>(scalar)); break;
        default: return refuse(comm.get(), ncclInvalidArgument, "ncclRedOpCreatePreMulSum: not a floating type");
    }
    std::lock_guard lock(comm->mutex);
    const int id = comm->next_op++;
    comm->premul[id] = value;
    *op = static_cast<ncclRedOp_t>(id);
    return ncclSuccess;
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t handle) {
    auto comm = find_comm(handle);
    if (!comm) return refuse(nullptr, ncclInvalidArgument, "ncclRedOpDestroy on a communicator NCCL does not know");
    std::lock_guard lock(comm->mutex);
    if (comm->premul.erase(int(op)) == 0) {
        comm->last_error = "ncclRedOpDestroy of an operator this communicator did not create";
        report_misuse(comm->last_error);
        return ncclInvalidArgument;
    }
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
    return issue("ncclAllReduce", part_of(NcclKind::allreduce, send, recv, count, type, op), comm, stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
    return issue("ncclReduceScatter", part_of(NcclKind::reduce_scatter, send, recv, count, type, op), comm, stream);
}

ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
    return issue("ncclAllGather", part_of(NcclKind::all_gather, send, recv, count, type), comm, stream);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    return issue("ncclBroadcast", part_of(NcclKind::broadcast, send, recv, count, type, ncclSum, root), comm, stream);
}

ncclResult_t ncclReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream) {
    return issue("ncclReduce", part_of(NcclKind::reduce, send, recv, count, type, op, root), comm, stream);
}

ncclResult_t ncclGroupStart() {
    ++group().depth;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    auto& g = group();
    if (g.depth == 0) return refuse(nullptr, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--g.depth > 0) return ncclSuccess;
    auto calls = std::exchange(g.calls, {});
    ncclResult_t result = ncclSuccess;
    for (auto& c : calls) {
        standin::detail::enqueue(*c.stream, [comm = c.comm, seq = c.seq, part = c.part] { run_part(comm, seq, part); });
        if (queued(*c.comm) == ncclInProgress) result = ncclInProgress;
    }
    return result;
}
