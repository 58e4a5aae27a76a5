// MpiSession (MPI initialised and finalised, processes of a torchrun-style launch joined),
// mpi_world() (the communicator of every rank of the job) and mpi_process_place() (this process's
// rank and local rank from MPI).
#pragma once

#include <gradsync/backend/mpi/join.hpp>
#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/backend/mpi/name_server.hpp>
#include <gradsync/environment.hpp>
#include <gradsync/error.hpp>

#include <chrono>
#include <cstring>  // for std::strncmp
#include <memory>
#include <string>
#include <vector>

namespace gradsync::inline v0 {

// Initialises MPI for the lifetime of the object, asking for MPI_THREAD_MULTIPLE, and finalises
// it at the end. When MPI is already initialised (by the program or another library) it does
// neither. Throws when MPI gives less than MPI_THREAD_SERIALIZED, which MpiBackend needs.
//
// Processes started by a torchrun-style launcher (RANK and WORLD_SIZE set, but each process a
// world of one to MPI) are joined into one communicator, mpi_world(), through MPI's name service
// (Open MPI: `ompi-server`). Named by OMPI_MCA_pmix_server_uri, the user's; else, where
// MASTER_ADDR and MASTER_PORT are set (torchrun sets them), rank 0 starts one for the job and
// serves its address on MASTER_PORT + 2 (backend/mpi/name_server.hpp), until this object goes.
// `join_timeout` bounds the wait for the other ranks. Such a world talks over the network
// transport even within one machine.
class MpiSession {
public:
    MpiSession() : MpiSession(nullptr, nullptr, default_join_timeout) {}
    explicit MpiSession(std::chrono::seconds join_timeout) : MpiSession(nullptr, nullptr, join_timeout) {}
    MpiSession(int& argc, char**& argv, std::chrono::seconds join_timeout = default_join_timeout)
        : MpiSession(&argc, &argv, join_timeout) {}
    MpiSession(const MpiSession&) = delete;
    MpiSession& operator=(const MpiSession&) = delete;
    ~MpiSession() {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (finalized) return;
        if (joined_) MPI_Comm_free(&detail::joined_world);
        claim_.reset();  // while MPI lives
        if (owner_) MPI_Finalize();
    }

    static constexpr std::chrono::seconds default_join_timeout{300};

    // What MPI provides: MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE.
    [[nodiscard]] int thread_level() const { return detail::mpi_thread_level(); }

private:
    MpiSession(int* argc, char*** argv, std::chrono::seconds join_timeout) {
        const auto launcher = process_place();
        int initialized = 0;
        MPI_Initialized(&initialized);
        if (!initialized) {
            detail::yield_when_oversubscribed(launcher);
            own_server_ = detail::meet_through_own_name_server(launcher, join_timeout);
            int provided = MPI_THREAD_SINGLE;
            const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
            if (rc != MPI_SUCCESS)
                throw CollectiveError("gradsync: MPI_Init_thread failed: " + detail::mpi_error_string(rc));
            owner_ = true;
        }
        const int level = detail::mpi_thread_level();
        if (level < MPI_THREAD_SERIALIZED)
            throw CollectiveError(std::string("gradsync: MPI provides only ") + detail::thread_level_name(level) +
                                  "; gradsync's MpiBackend needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (its "
                                  "progress thread calls MPI). Use an MPI library built with thread support.");
        int size = 1;
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        if (size == 1 && launcher.world_size > 1 && detail::joined_world == MPI_COMM_NULL) {
            auto joined = detail::join_singletons(launcher, join_timeout);
            detail::joined_world = joined.comm;
            claim_ = std::move(joined.claim);
            joined_ = true;
        }
        own_server_.announcer.reset();  // every rank has joined: nobody asks any more
    }

    detail::OwnNameServer own_server_;  // first: it goes last, after MPI_Finalize
    bool owner_ = false;
    bool joined_ = false;
    std::unique_ptr<detail::RankClaim> claim_;  // this process's RANK, claimed while the world lives
};

// The communicator of every rank of the job: MPI_COMM_WORLD, or the one MpiSession joined.
inline MPI_Comm mpi_world() { return detail::joined_world != MPI_COMM_NULL ? detail::joined_world : MPI_COMM_WORLD; }

namespace detail {

// Splits `comm` by machine. MPI_COMM_TYPE_SHARED knows only the processes one launch started, so a
// joined world goes by processor name instead.
inline MPI_Comm split_by_node(MPI_Comm comm, int rank) {
    MPI_Comm node = MPI_COMM_NULL;
    if (joined_world == MPI_COMM_NULL) {
        MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
        return node;
    }
    int size = 1;
    MPI_Comm_size(comm, &size);
    std::vector<char> names(static_cast<std::size_t>(size) * MPI_MAX_PROCESSOR_NAME);
    char mine[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    MPI_Get_processor_name(mine, &length);
    MPI_Allgather(mine, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm);
    int color = rank;  // the first rank on this machine
    for (int r = 0; r < size; ++r)
        if (std::strncmp(names.data() + std::size_t(r) * MPI_MAX_PROCESSOR_NAME, mine, MPI_MAX_PROCESSOR_NAME) == 0) {
            color = r;
            break;
        }
    MPI_Comm_split(comm, color, rank, &node);
    return node;
}

}  // namespace detail

// This process's place from MPI: rank and size in `comm`, local rank and size among the ranks
// that share its machine. When a launcher's variables (process_place()) say otherwise for the
// world, throws: the processes were started by a launcher that is not MPI's and MPI was
// initialised without MpiSession, which would have joined them. Where they agree on the world
// but set a local rank and size (LOCAL_RANK/LOCAL_WORLD_SIZE) that differ from MPI's, throws too.
inline ProcessPlace mpi_process_place(MPI_Comm comm = mpi_world()) {
    ProcessPlace place;
    MPI_Comm_rank(comm, &place.rank);
    MPI_Comm_size(comm, &place.world_size);
    MPI_Comm node = detail::split_by_node(comm, place.rank);
    MPI_Comm_rank(node, &place.local_rank);
    MPI_Comm_size(node, &place.local_world_size);
    MPI_Comm_free(&node);
    place.source = "MPI";
    int same = MPI_UNEQUAL;
    MPI_Comm_compare(comm, mpi_world(), &same);
    if (same == MPI_IDENT || same == MPI_CONGRUENT) {
        const auto launcher = process_place();
        if (auto problem = detail::exported_rank_problem(launcher, place, detail::real_env); !problem.empty())
            throw Error(problem);
        if (launcher.world_size > 1 && (launcher.rank != place.rank || launcher.world_size != place.world_size))
            throw Error("gradsync: " + launcher.source + " say rank " + std::to_string(launcher.rank) + " of " +
                        std::to_string(launcher.world_size) + " but MPI says rank " + std::to_string(place.rank) +
                        " of " + std::to_string(place.world_size) +
                        ": these processes were not started by an MPI launcher, and MPI was initialised without "
                        "gradsync::MpiSession, which joins such processes. " +
                        detail::join_advice(launcher));
        if (launcher.world_size > 1) {
            if (auto problem = detail::local_place_problem(launcher, place, detail::real_env); !problem.empty())
                throw Error(problem);
        }
    }
    return place;
}

}  // namespace gradsync::inline v0
