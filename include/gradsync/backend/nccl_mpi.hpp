// NCCL's unique id through an MPI communicator: how an NCCL communicator is bootstrapped when the
// processes already share MPI (mpirun, srun, or a world MpiSession joined). Not included by
// <gradsync/gradsync.hpp>: include it where <nccl.h> and <mpi.h> are available, and link NCCL and MPI.
//
//   gradsync::MpiSession mpi(argc, argv);
//   const ncclUniqueId id = gradsync::nccl_unique_id();  // collective over mpi_world()
//   ncclCommInitRank(&comm, size, id, rank);
#pragma once

#include <gradsync/backend/mpi.hpp>
#include <gradsync/error.hpp>

#include <nccl.h>

#include <algorithm>  // for std::min
#include <cstring>    // for std::strlen
#include <string>

namespace gradsync::inline v0 {

// Collective over `comm`: `root` creates the id with ncclGetUniqueId and every rank returns it.
// When the root cannot create one, every rank throws the same CollectiveError, with NCCL's
// explanation, rather than waiting for an id that never comes.
inline ncclUniqueId nccl_unique_id(MPI_Comm comm = mpi_world(), int root = 0) {
    struct Message {
        int result = ncclSuccess;
        char why[256] = {};  // ncclGetLastError on the root
        ncclUniqueId id{};
    } message;
    int rank = 0;
    MPI_Comm_rank(comm, &rank);
    if (rank == root) {
        message.result = static_cast<int>(ncclGetUniqueId(&message.id));
        if (message.result != ncclSuccess) {
            const char* why = ncclGetLastError(nullptr);
            const std::size_t length = why ? std::min(std::strlen(why), sizeof message.why - 1) : 0;
            std::copy_n(why, length, message.why);
        }
    }
    const int rc = MPI_Bcast(&message, sizeof message, MPI_BYTE, root, comm);
    if (rc != MPI_SUCCESS)
        throw CollectiveError(detail::rank_prefix(rank) +
                              ": MPI_Bcast of NCCL's unique id failed: " + detail::mpi_error_string(rc));
    if (message.result != ncclSuccess)
        throw CollectiveError("gradsync: ncclGetUniqueId failed on rank " + std::to_string(root) + ": " +
                              ncclGetErrorString(static_cast<ncclResult_t>(message.result)) + " (" + message.why + ")");
    return message.id;
}

}  // namespace gradsync::inline v0
