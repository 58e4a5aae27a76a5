// The torchrun-style join: processes that a launcher other than MPI's started (RANK and
// WORLD_SIZE set, each process a world of one to MPI) meet through MPI's name service and become
// one communicator, by a deadline.
#pragma once

#include <gradsync/backend/detail/watcher_thread.hpp>
#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/detail/end_process.hpp>
#include <gradsync/detail/hash.hpp>
#include <gradsync/environment.hpp>
#include <gradsync/error.hpp>

#include <signal.h>  // for kill
#include <unistd.h>  // for gethostname, getpid

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>   // for std::fprintf, std::snprintf
#include <cstdlib>  // for setenv, strtol
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace gradsync::inline v0::detail {

// The communicator MpiSession built by joining processes that MPI did not start; MPI_COMM_NULL
// when there is none (MPI_COMM_WORLD holds every rank).
inline MPI_Comm joined_world = MPI_COMM_NULL;

// The variables that name a job, in the names its ranks meet under, so that jobs sharing a name
// server never meet: ours, torchrun's run id and address, paddle.distributed.launch's endpoints
// (the address and port it chose for each rank), Slurm's job.
inline constexpr const char* job_identity_variables[] = {"GRADSYNC_JOB_ID", "TORCHELASTIC_RUN_ID",      "MASTER_ADDR",
                                                         "MASTER_PORT",     "PADDLE_TRAINER_ENDPOINTS", "SLURM_JOB_ID"};

// Open MPI's name service takes names of at most 511 characters: an identity longer than this
// (a long GRADSYNC_JOB_ID) is named by its hash instead, the same in every process.
inline constexpr std::size_t max_identity_text = 256;

// The name the job's ranks meet under, or "" when nothing names the job.
inline std::string join_service(const ProcessPlace& place, EnvLookup lookup = real_env) {
    std::string identity;
    for (const char* variable : job_identity_variables)
        if (auto value = lookup(variable)) identity += std::string(":") + variable + "=" + *value;
    if (identity.empty()) return {};
    if (identity.size() > max_identity_text) {
        char hex[17] = {};
        std::snprintf(hex, sizeof hex, "%016llx",
                      static_cast<unsigned long long>(content_hash(identity.data(), identity.size())));
        identity = ":identity-hash=" + std::string(hex) + ":length=" + std::to_string(identity.size());
    }
    return "gradsync" + identity + ":world=" + std::to_string(place.world_size);
}

// Who holds a claim: "host:pid".
inline std::string claimant() {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    return std::string(host) + ":" + std::to_string(::getpid());
}

// Whether a claim by "host:pid" is left over from a process of this machine that is gone.
inline bool stale_claim(const std::string& owner) {
    const auto colon = owner.rfind(':');
    if (colon == std::string::npos) return false;
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    if (owner.substr(0, colon) != host) return false;  // another machine's: cannot tell
    const long pid = std::strtol(owner.c_str() + colon + 1, nullptr, 10);
    return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

// Each rank claims its RANK in the name service before it joins, and holds the claim while the
// joined world lives: a second process given the same RANK (in this job, or in another job given
// the same identity while this one runs) finds it claimed and stops at once, instead of waiting
// out the join's deadline or joining where it does not belong. The name service may keep one entry per publisher, so a
// claim counts once it is the one a lookup finds; a claim left by a crashed process of this
// machine is taken over.
class RankClaim {
public:
    RankClaim(const std::string& service, const ProcessPlace& place, const std::string& who)
        : name_(service + ":rank=" + std::to_string(place.rank)), owner_(claimant()) {
        ErrorsReturned self_errors(MPI_COMM_SELF);
        ErrorsReturned world_errors(MPI_COMM_WORLD);  // the name service reports through it
        const auto holder = [&]() -> std::string {
            char found[MPI_MAX_PORT_NAME] = {};
            if (MPI_Lookup_name(name_.c_str(), MPI_INFO_NULL, found) != MPI_SUCCESS) return {};
            return found;
        };
        std::string held = holder();
        if (!held.empty() && held != owner_ && stale_claim(held)) {
            MPI_Unpublish_name(name_.c_str(), MPI_INFO_NULL, held.c_str());
            held = holder();
        }
        if (held.empty() && MPI_Publish_name(name_.c_str(), MPI_INFO_NULL, owner_.c_str()) == MPI_SUCCESS) {
            published_ = true;
            held = holder();
        }
        if (held == owner_) return;
        if (published_) MPI_Unpublish_name(name_.c_str(), MPI_INFO_NULL, owner_.c_str());
        throw CollectiveError(who + ": two processes were given RANK=" + std::to_string(place.rank) + ": process " +
                              (held.empty() ? std::string("?") : held) +
                              " of this job already holds it. Give each of 0.." + std::to_string(place.world_size - 1) +
                              " to one process, or give this run its own GRADSYNC_JOB_ID if another job shares the "
                              "name server");
    }
    RankClaim(const RankClaim&) = delete;
    RankClaim& operator=(const RankClaim&) = delete;
    ~RankClaim() {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (finalized) return;  // MPI ended first: the name service is gone with it
        ErrorsReturned self_errors(MPI_COMM_SELF);
        ErrorsReturned world_errors(MPI_COMM_WORLD);
        if (published_) MPI_Unpublish_name(name_.c_str(), MPI_INFO_NULL, owner_.c_str());
    }

private:
    std::string name_, owner_;
    bool published_ = false;
};

inline std::string join_advice(const ProcessPlace& place) {
    return "Start the processes with mpirun -np " + std::to_string(place.world_size) +
           " (or srun); or set MASTER_ADDR and MASTER_PORT for every process (torchrun does), and rank 0 serves "
           "them a name server; or give them one of your own: run `ompi-server -r FILE` once and set "
           "OMPI_MCA_pmix_server_uri=file:FILE for every process.";
}

// A world joined from singletons, and this process's claim on its RANK, held as long as the world.
struct JoinedWorld {
    MPI_Comm comm = MPI_COMM_NULL;
    std::unique_ptr<RankClaim> claim;
};

// Processes started by a launcher that is not MPI's (torchrun-style RANK/WORLD_SIZE) are MPI
// singletons, a world of one each. They meet through MPI's name service: rank 0 opens a port,
// and the group, growing from rank 0, publishes it for each next rank in turn, accepts it and
// merges it in. A watchdog ends a join that has not completed by the deadline (a rank that never
// starts, or a RANK given twice), naming how many ranks arrived.
inline JoinedWorld join_singletons(const ProcessPlace& place, std::chrono::seconds timeout) {
    const std::string who = rank_prefix(place.rank, place.world_size, place.source);
#ifdef OPEN_MPI
    // Without a name server each singleton publishes and looks up only in its own world: the
    // lookup would fail until the deadline. Say so at once.
    if (!real_env("OMPI_MCA_pmix_server_uri"))
        throw CollectiveError(who +
                              " was not started by an MPI launcher, and OMPI_MCA_pmix_server_uri names no "
                              "name server through which the ranks could connect. " +
                              join_advice(place));
#endif
    const std::string service = join_service(place);
    if (service.empty())
        throw CollectiveError(who +
                              ": nothing names this job, so it could meet another job's ranks in the name server: "
                              "set GRADSYNC_JOB_ID to a name of this run (or MASTER_ADDR and MASTER_PORT, as "
                              "torchrun does), the same for every rank");
    auto claim = std::make_unique<RankClaim>(service, place, who);
    std::atomic<int> joined{1};
    const auto deadline = detail::deadline_after(timeout);
    WatcherThread watcher([deadline] { return deadline; },
                          [&] {
                              std::fprintf(stderr,
                                           "%s: the ranks have not all joined after %lld s (%d of %d are in); a rank "
                                           "did not start, or they do not share a name server and a job "
                                           "identity (GRADSYNC_JOB_ID, MASTER_ADDR, MASTER_PORT). %s\n",
                                           who.c_str(), static_cast<long long>(timeout.count()), joined.load(),
                                           place.world_size, join_advice(place).c_str());
                              std::fflush(stderr);
                              detail::end_process_once([] { MPI_Abort(MPI_COMM_SELF, 1); });
                          });

    ErrorsReturned self_errors(MPI_COMM_SELF);
    ErrorsReturned world_errors(MPI_COMM_WORLD);
    auto check = [&](int rc, const char* call) {
        if (rc != MPI_SUCCESS)
            throw CollectiveError(who + ": " + call + " failed while joining the ranks: " + mpi_error_string(rc) +
                                  ". " + join_advice(place));
    };
    // Ranks join one at a time, in order: the group publishes the port under rank r's own name
    // only when it is ready to accept rank r, and connects every pair of its members before it
    // publishes the next. Open MPI 4.1 can deadlock when a connect is pending while the group
    // merges or opens connections (seen here with 4 ranks under load), and in order, the joined
    // group is ordered by RANK as it grows.
    const auto turn = [&](int rank) { return service + ":" + std::to_string(rank); };
    const auto connect_all_pairs = [&](MPI_Comm comm) {
        int size = 1;
        MPI_Comm_size(comm, &size);
        std::vector<int> out(static_cast<std::size_t>(size)), in(out.size());
        check(MPI_Alltoall(out.data(), 1, MPI_INT, in.data(), 1, MPI_INT, comm), "MPI_Alltoall");
    };
    char port[MPI_MAX_PORT_NAME] = {};
    MPI_Comm group = MPI_COMM_NULL;
    MPI_Comm inter = MPI_COMM_NULL;
    if (place.rank == 0) {
        check(MPI_Open_port(MPI_INFO_NULL, port), "MPI_Open_port");
        check(MPI_Comm_dup(MPI_COMM_SELF, &group), "MPI_Comm_dup");
    } else {
        // Not published until the ranks before this one are in; the watchdog bounds the wait.
        while (MPI_Lookup_name(turn(place.rank).c_str(), MPI_INFO_NULL, port) != MPI_SUCCESS)
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        check(MPI_Comm_connect(port, MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter), "MPI_Comm_connect");
        check(MPI_Intercomm_merge(inter, 1, &group), "MPI_Intercomm_merge");
        MPI_Comm_free(&inter);
    }
    MPI_Comm_set_errhandler(group, MPI_ERRORS_RETURN);  // inherited by the groups it grows into
    if (place.rank != 0) connect_all_pairs(group);
    for (int size = 0; MPI_Comm_size(group, &size), size < place.world_size;) {
        joined = size;
        const std::string name = turn(size);  // the next rank's
        if (place.rank == 0) {
            const int rc = MPI_Publish_name(name.c_str(), MPI_INFO_NULL, port);
            if (rc != MPI_SUCCESS)
                throw CollectiveError(
                    who + ": MPI_Publish_name(\"" + name + "\") failed: " + mpi_error_string(rc) +
                    ". Another run with the same job identity (GRADSYNC_JOB_ID, MASTER_ADDR, MASTER_PORT) "
                    "is using the name server.");
        }
        check(MPI_Comm_accept(port, MPI_INFO_NULL, 0, group, &inter), "MPI_Comm_accept");
        if (place.rank == 0) MPI_Unpublish_name(name.c_str(), MPI_INFO_NULL, port);
        MPI_Comm grown = MPI_COMM_NULL;
        check(MPI_Intercomm_merge(inter, 0, &grown), "MPI_Intercomm_merge");
        MPI_Comm_free(&inter);
        MPI_Comm_free(&group);
        group = grown;
        connect_all_pairs(group);
    }
    joined = place.world_size;
    if (place.rank == 0) MPI_Close_port(port);
    // A RANK given twice can still fill a later rank's place (its connect was pending on the same
    // port): every process must sit where its RANK says.
    std::vector<int> ranks(static_cast<std::size_t>(place.world_size));
    check(MPI_Allgather(&place.rank, 1, MPI_INT, ranks.data(), 1, MPI_INT, group), "MPI_Allgather");
    std::string given;
    bool in_place = true;
    for (std::size_t i = 0; i < ranks.size(); ++i) {
        in_place = in_place && ranks[i] == int(i);
        given += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
    }
    if (!in_place) {
        MPI_Comm_free(&group);
        throw CollectiveError(who + ": the joined processes were given the ranks " + given + "; each of 0.." +
                              std::to_string(place.world_size - 1) + " must be given once.");
    }
    MPI_Comm_set_errhandler(group, MPI_ERRORS_ARE_FATAL);  // as MPI_COMM_WORLD's
    return {group, std::move(claim)};
}

// mpirun tells the processes it oversubscribes to yield the core while they wait for messages;
// processes that wait by spinning on fewer cores than processes slow each other down a
// hundredfold. A torchrun-style launch has no mpirun to say so: say it for Open MPI, unless the
// user did. Before MPI_Init, which reads it.
inline void yield_when_oversubscribed([[maybe_unused]] const ProcessPlace& launcher) {
#ifdef OPEN_MPI
    if (launcher.world_size <= 1 || real_env("OMPI_COMM_WORLD_SIZE") || real_env("OMPI_MCA_mpi_yield_when_idle"))
        return;
    if (unsigned(launcher.local_world_size) > std::thread::hardware_concurrency())
        ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
#endif
}

}  // namespace gradsync::inline v0::detail
