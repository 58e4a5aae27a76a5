// A SharedMemoryBackend over the processes of an MPI communicator that share one machine (say,
// mpi_node_comm()), its name agreed through MPI: the node level of a TwoLevelBackend whose level
// across machines is an MpiBackend, or the whole job on one machine.
#pragma once

#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/backend/mpi/session.hpp>  // for detail::split_by_node
#include <gradsync/backend/shared_memory.hpp>
#include <gradsync/error.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include <fcntl.h>     // for O_CREAT, O_EXCL, O_RDWR, O_RDONLY
#include <sys/mman.h>  // for shm_open, shm_unlink
#include <unistd.h>    // for getpid, close

namespace gradsync::inline v0 {

// Collective over `node`, whose processes must all run on this machine. The object's name is
// made from rank 0's process id and a count of the groups it has made, so it is unique on the
// machine while the job runs.
inline std::unique_ptr<SharedMemoryBackend> shared_memory_group(MPI_Comm node, SharedMemoryOptions options = {}) {
    static std::atomic<std::int64_t> made{0};
    int rank = 0, size = 1;
    MPI_Comm_rank(node, &rank);
    MPI_Comm_size(node, &size);
    // Ranks on other machines would wait for an object they cannot see: refuse, on every rank.
    MPI_Comm same_machine = detail::split_by_node(node, rank);
    int here = 0;
    MPI_Comm_size(same_machine, &here);
    MPI_Comm_free(&same_machine);
    int everywhere = 0;
    MPI_Allreduce(&here, &everywhere, 1, MPI_INT, MPI_MIN, node);
    if (everywhere != size)
        throw Error("gradsync: shared_memory_group: the " + std::to_string(size) +
                    " processes of this communicator are not all on one machine (the smallest set on one holds " +
                    std::to_string(everywhere) + "); give it the ranks of one node, e.g. mpi_node_comm()");
    std::int64_t id[2] = {static_cast<std::int64_t>(::getpid()), made.fetch_add(1)};
    const int rc = MPI_Bcast(id, 2, MPI_INT64_T, 0, node);
    if (rc != MPI_SUCCESS)
        throw CollectiveError("gradsync: shared_memory_group: agreeing on the shared memory's name failed: " +
                              detail::mpi_error_string(rc));
    const std::string name = "/gradsync-" + std::to_string(id[0]) + "-" + std::to_string(id[1]);
    // Processes of one machine that do not share /dev/shm (containers, mount namespaces) would
    // wait for the object until the timeout: a probe first, so that every rank refuses at once.
    const std::string probe = name + "-probe";
    int seen = 1;
    if (rank == 0) {
        const int fd = ::shm_open(probe.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        seen = fd >= 0 ? 1 : 0;
        if (fd >= 0) ::close(fd);
    }
    MPI_Barrier(node);
    if (rank != 0) {
        const int fd = ::shm_open(probe.c_str(), O_RDONLY, 0600);
        seen = fd >= 0 ? 1 : 0;
        if (fd >= 0) ::close(fd);
    }
    int all_seen = 0;
    MPI_Allreduce(&seen, &all_seen, 1, MPI_INT, MPI_MIN, node);
    if (rank == 0) ::shm_unlink(probe.c_str());
    if (all_seen == 0)
        throw Error("gradsync: shared_memory_group: some processes of this communicator do not see /dev/shm" + probe +
                    ", which rank 0 made: they share the machine but not its /dev/shm (separate containers or "
                    "mount namespaces); share it between them, or use MpiBackend");
    return std::make_unique<SharedMemoryBackend>(name, rank, size, options);
}

}  // namespace gradsync::inline v0
