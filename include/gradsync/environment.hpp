// Where this process stands in a multi-process run: rank, world size, local rank and local world
// size, read from the variables launchers set (torchrun, paddle.distributed.launch, Open MPI's
// mpirun, MPICH/PMI, Slurm's srun), with a clear error when they are missing or disagree.
#pragma once

#include <gradsync/error.hpp>

#include <cstdlib>  // for std::getenv
#include <optional>
#include <string>
#include <vector>

namespace gradsync::inline v0 {

struct ProcessPlace {
    int rank = 0;
    int world_size = 1;
    int local_rank = 0;
    int local_world_size = 1;
    std::string source;  // which launcher's variables said so, e.g. "RANK/WORLD_SIZE"

    friend bool operator==(const ProcessPlace&, const ProcessPlace&) = default;
};

namespace detail {

// Reads an environment variable; `lookup` is swappable so that tests need not touch the process's.
using EnvLookup = std::optional<std::string> (*)(const char*);

inline std::optional<std::string> real_env(const char* name) {
    const char* v = std::getenv(name);
    if (v == nullptr) return std::nullopt;
    return std::string(v);
}

inline int parse_count(const char* name, const std::string& text) {
    std::size_t used = 0;
    long value = -1;
    try {
        value = std::stol(text, &used);
    } catch (...) {
        used = 0;
    }
    if (used != text.size() || text.empty() || value < 0 || value > 1'000'000)
        throw Error("gradsync: environment variable " + std::string(name) + "='" + text +
                    "' is not a non-negative whole number");
    return static_cast<int>(value);
}

struct Scheme {
    const char* rank;
    const char* size;
    const char* local_rank;
    const char* local_size;
};

// Innermost launcher first: torchrun's variables, paddle.distributed.launch's, then mpirun's (Open
// MPI, MPICH/PMI), then Slurm's.
inline constexpr Scheme schemes[] = {
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_RANK_IN_NODE", "PADDLE_LOCAL_SIZE"},
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
};

inline ProcessPlace place_from(EnvLookup lookup) {
    std::vector<ProcessPlace> found;
    for (const auto& s : schemes) {
        auto rank = lookup(s.rank);
        auto size = lookup(s.size);
        if (!rank && !size) continue;
        const std::string source = std::string(s.rank) + "/" + s.size;
        if (!rank || !size)
            throw Error("gradsync: " + std::string(rank ? s.rank : s.size) + " is set but " +
                        std::string(rank ? s.size : s.rank) + " is not; a launcher sets both");
        ProcessPlace p;
        p.source = source;
        p.rank = parse_count(s.rank, *rank);
        p.world_size = parse_count(s.size, *size);
        if (p.world_size < 1 || p.rank >= p.world_size)
            throw Error("gradsync: " + std::string(s.rank) + "=" + std::to_string(p.rank) + " is not a rank of " +
                        s.size + "=" + std::to_string(p.world_size));
        // Without local variables: one process per machine, as far as anyone said.
        p.local_rank = 0;
        if (auto lr = lookup(s.local_rank)) p.local_rank = parse_count(s.local_rank, *lr);
        p.local_world_size = p.local_rank + 1;
        if (s.local_size != nullptr) {
            if (auto ls = lookup(s.local_size)) p.local_world_size = parse_count(s.local_size, *ls);
        }
        if (p.local_rank >= p.local_world_size)
            throw Error("gradsync: local rank " + std::to_string(p.local_rank) + " from " + s.local_rank +
                        " is not below the local world size " + std::to_string(p.local_world_size));
        found.push_back(p);
    }
    if (found.empty()) return ProcessPlace{0, 1, 0, 1, "no launcher variables: a single process"};
    // The innermost launcher wins: torchrun inside srun or mpirun, mpirun inside srun. An inner
    // launcher starts one or more processes for each task of the one around it, and numbers them
    // its own way; an outer world larger than the inner one is a mistake (variables left over from
    // another run).
    for (std::size_t i = 1; i < found.size(); ++i) {
        if (found[i].world_size > found[0].world_size)
            throw Error("gradsync: the launchers' variables disagree: " + found[0].source + " say rank " +
                        std::to_string(found[0].rank) + " of " + std::to_string(found[0].world_size) + ", " +
                        found[i].source + " say rank " + std::to_string(found[i].rank) + " of " +
                        std::to_string(found[i].world_size) + ": more processes than the launcher inside it starts. " +
                        "Are " + found[0].source + " left over in the environment from another run?");
    }
    return found[0];
}

// Checks the launcher's local rank and local world size against those of `found` (MPI's: the
// processes that share this machine), where the launcher set both: a launcher that numbers a
// machine's processes otherwise than they lie (two torchruns on one machine, variables left over
// from another run) would give two processes one GPU. Returns the problem, or nothing.
inline std::string local_place_problem(const ProcessPlace& launcher, const ProcessPlace& found, EnvLookup lookup) {
    for (const auto& s : schemes) {
        if (launcher.source != std::string(s.rank) + "/" + s.size) continue;
        if (s.local_size == nullptr || !lookup(s.local_rank) || !lookup(s.local_size)) return {};
        if (launcher.local_rank == found.local_rank && launcher.local_world_size == found.local_world_size) return {};
        return "gradsync: " + std::string(s.local_rank) + "/" + s.local_size + " say local rank " +
               std::to_string(launcher.local_rank) + " of " + std::to_string(launcher.local_world_size) +
               " on this machine, but " + found.source + " finds " + std::to_string(found.local_world_size) +
               " processes of the job here, this one local rank " + std::to_string(found.local_rank) +
               ": a GPU chosen by " + s.local_rank + " could be another process's too. Start one launcher per " +
               "machine, or set " + s.local_rank + " and " + s.local_size + " as the processes lie";
    }
    return {};
}

// Where an MPI launcher (mpirun, mpiexec) started this process as MPI numbers it (`mpi`) but the
// innermost launcher's variables (`launcher`: torchrun's RANK, say) give another rank: those
// were handed to every process (exported in the shell, or passed with mpirun -x), so every
// process would claim the same rank. Returns the problem, or nothing.
inline std::string exported_rank_problem(const ProcessPlace& launcher, const ProcessPlace& mpi, EnvLookup lookup) {
    if (launcher.rank == mpi.rank && launcher.world_size == mpi.world_size) return {};
    for (const auto& s : schemes) {
        const std::string source = std::string(s.rank) + "/" + s.size;
        if (!source.starts_with("OMPI_") && !source.starts_with("PMI_")) continue;
        if (source == launcher.source) return {};
        const auto rank = lookup(s.rank), size = lookup(s.size);
        if (!rank || !size || parse_count(s.rank, *rank) != mpi.rank || parse_count(s.size, *size) != mpi.world_size)
            continue;
        return "gradsync: " + launcher.source + " say rank " + std::to_string(launcher.rank) + " of " +
               std::to_string(launcher.world_size) + ", but an MPI launcher started this process as rank " +
               std::to_string(mpi.rank) + " of " + std::to_string(mpi.world_size) + " (" + source +
               "): " + launcher.source + " were given to every process (exported in the shell, or passed with " +
               "mpirun -x). Unset them when starting with mpirun, or start the processes with torchrun alone";
    }
    return {};
}

}  // namespace detail

// This process's place, from the environment the launcher left: where launchers are nested
// (torchrun started by srun), the innermost one's variables. A process started without a launcher
// is rank 0 of 1. Throws when the variables are malformed or incomplete, or when a launcher
// around another claims more processes than the inner one has.
inline ProcessPlace process_place() { return detail::place_from(detail::real_env); }

}  // namespace gradsync::inline v0
