// MpiBackend: one rank per process (mpirun, srun, or any MPI-3 launcher), collectives through
// MPI on a communicator of its own. Not included by <gradsync/gradsync.hpp>: include this header
// where <mpi.h> is available and link MPI (CMake: MPI::MPI_CXX).
//
// Threads: synchronous collectives run on the caller's thread, asynchronous ones on a progress
// thread, never two at once, so MPI must give at least MPI_THREAD_SERIALIZED (MpiSession asks for
// MPI_THREAD_MULTIPLE). No silent hangs: a watchdog thread ends the job when a collective has not
// completed by the deadline, after printing which rank waited in which collective. MPI cannot
// cancel a collective, so a stuck one cannot be turned into an exception the process survives.
#pragma once

#include <gradsync/backend.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/detail/host_reduce.hpp>
#include <gradsync/detail/async_collectives.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/environment.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

// Only MPI's C interface is used; skip the deprecated C++ bindings some MPIs still ship.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>  // for std::min
#include <atomic>
#include <chrono>
#include <climits>  // for INT_MAX
#include <condition_variable>
#include <cstddef>
#include <cstdio>   // for std::fprintf
#include <cstdlib>  // for std::_Exit
#include <cstring>  // for std::memcpy
#include <exception>
#include <functional>  // for std::function
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0 {

namespace detail {

inline std::string mpi_error_string(int code) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
    return std::string(text, static_cast<std::size_t>(length));
}

inline const char* thread_level_name(int level) {
    switch (level) {
        case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
        case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
        case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
        case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
        default: return "an unknown thread level";
    }
}

inline int mpi_thread_level() {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    return level;
}

// out[i] = (out[i] + in[i]) * factor, in the accumulator type of the dtype; factor 1 multiplies
// nothing. (x + y) * f rounds exactly as a sum followed by a separate scaling pass would.
template <class T>
void add_scaled(T* __restrict out, const T* __restrict in, T factor, std::size_t n) {
    if (factor == T(1)) {
        add_into(out, in, n);
        return;
    }
    const std::size_t full = n - n % simd_width;
    std::size_t i = 0;
    for (; i < full; i += simd_width)
        for (std::size_t j = 0; j < simd_width; ++j) out[i + j] = (out[i + j] + in[i + j]) * factor;
    for (; i < n; ++i) out[i] = (out[i] + in[i]) * factor;
}

template <class S>
void add_scaled_16(S* out, const S* in, float factor, std::size_t n) {
    constexpr std::size_t block = 512;
    float a[block];
    float b[block];
    for (std::size_t off = 0; off < n; off += block) {
        const std::size_t k = std::min(block, n - off);
        widen_to_float(in + off, a, k);
        widen_to_float(out + off, b, k);
        add_scaled(b, a, factor, k);
        narrow_from_float(b, out + off, k);
    }
}

// MPI's user-defined reductions for the 16-bit types: widen, add in float, round once.
template <class S>
void mpi_sum_16(void* in, void* inout, int* len, MPI_Datatype*) {
    add_scaled_16(static_cast<S*>(inout), static_cast<const S*>(in), 1.0f, static_cast<std::size_t>(*len));
}

inline void add_received(std::byte* out, const std::byte* in, std::size_t n, DType t, double factor) {
    switch (t) {
        case DType::float64:
            add_scaled(reinterpret_cast<double*>(out), reinterpret_cast<const double*>(in), factor, n);
            break;
        case DType::float16:
            add_scaled_16(reinterpret_cast<float16*>(out), reinterpret_cast<const float16*>(in), float(factor), n);
            break;
        case DType::bfloat16:
            add_scaled_16(reinterpret_cast<bfloat16*>(out), reinterpret_cast<const bfloat16*>(in), float(factor), n);
            break;
        default: add_scaled(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(in), float(factor), n); break;
    }
}

template <class S>
void scale_16(S* data, float factor, std::size_t n) {
    constexpr std::size_t block = 1024;
    float tmp[block];
    for (std::size_t off = 0; off < n; off += block) {
        const std::size_t k = std::min(block, n - off);
        widen_to_float(data + off, tmp, k);
        for (std::size_t i = 0; i < k; ++i) tmp[i] *= factor;
        narrow_from_float(tmp, data + off, k);
    }
}

// The communicator MpiSession built by joining processes that MPI did not start; MPI_COMM_NULL
// when there is none (MPI_COMM_WORLD holds every rank).
inline MPI_Comm joined_world = MPI_COMM_NULL;

// Makes a communicator's errors come back as return codes for the guard's lifetime.
class ErrorsReturned {
public:
    explicit ErrorsReturned(MPI_Comm comm) : comm_(comm) {
        MPI_Comm_get_errhandler(comm_, &previous_);
        MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    }
    ErrorsReturned(const ErrorsReturned&) = delete;
    ErrorsReturned& operator=(const ErrorsReturned&) = delete;
    ~ErrorsReturned() {
        MPI_Comm_set_errhandler(comm_, previous_);
        MPI_Errhandler_free(&previous_);
    }

private:
    MPI_Comm comm_;
    MPI_Errhandler previous_ = MPI_ERRHANDLER_NULL;
};

// The name rank 0 publishes its port under: one per job, so that jobs sharing a name server
// do not meet.
inline std::string join_service(const ProcessPlace& place) {
    std::string name = "gradsync";
    for (const char* variable : {"MASTER_ADDR", "MASTER_PORT"})
        if (auto value = real_env(variable)) name += ":" + *value;
    return name + ":" + std::to_string(place.world_size);
}

inline std::string join_advice(const ProcessPlace& place) {
    return "Start the processes with mpirun -np " + std::to_string(place.world_size) +
           " (or srun), or give them a name server to meet through: run `ompi-server -r FILE` once and set "
           "OMPI_MCA_pmix_server_uri=file:FILE for every process.";
}

// Processes started by a launcher that is not MPI's (torchrun-style RANK/WORLD_SIZE) are MPI
// singletons, a world of one each. They meet through MPI's name service: rank 0 opens a port,
// and the group, growing from rank 0, publishes it for each next rank in turn, accepts it and
// merges it in. A watchdog ends a join that has not completed by the deadline (a rank that never
// starts, or a RANK given twice), naming how many ranks arrived.
inline MPI_Comm join_singletons(const ProcessPlace& place, std::chrono::seconds timeout) {
    const std::string who = "gradsync: rank " + std::to_string(place.rank) + " of " + std::to_string(place.world_size) +
                            " (" + place.source + ")";
#ifdef OPEN_MPI
    // Without a name server each singleton publishes and looks up only in its own world: the
    // lookup would fail until the deadline. Say so at once.
    if (!real_env("OMPI_MCA_pmix_server_uri"))
        throw CollectiveError(who +
                              " was not started by an MPI launcher, and OMPI_MCA_pmix_server_uri names no "
                              "name server through which the ranks could connect. " +
                              join_advice(place));
#endif
    std::mutex mutex;
    std::condition_variable wake;
    bool done = false;
    std::atomic<int> joined{1};
    std::thread watchdog([&] {
        std::unique_lock lock(mutex);
        if (wake.wait_for(lock, timeout, [&] { return done; })) return;
        std::fprintf(stderr,
                     "%s: the ranks have not all joined after %lld s (%d of %d are in); a rank did not start, two "
                     "were given the same RANK, or they do not share a name server. %s\n",
                     who.c_str(), static_cast<long long>(timeout.count()), joined.load(), place.world_size,
                     join_advice(place).c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_SELF, 1);
    });
    struct StopWatchdog {
        std::mutex& mutex;
        std::condition_variable& wake;
        bool& done;
        std::thread& thread;
        ~StopWatchdog() {
            {
                std::lock_guard lock(mutex);
                done = true;
            }
            wake.notify_all();
            thread.join();
        }
    } stop{mutex, wake, done, watchdog};

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
    const std::string service = join_service(place);
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
                throw CollectiveError(who + ": MPI_Publish_name(\"" + name + "\") failed: " + mpi_error_string(rc) +
                                      ". Another job with the same MASTER_ADDR/MASTER_PORT is using the name server, "
                                      "or two processes were given RANK=0.");
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
    return group;
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

}  // namespace detail

// Initialises MPI for the lifetime of the object, asking for MPI_THREAD_MULTIPLE, and finalises
// it at the end. When MPI is already initialised (by the program or another library) it does
// neither. Throws when MPI gives less than MPI_THREAD_SERIALIZED, which MpiBackend needs.
//
// Processes started by a torchrun-style launcher (RANK and WORLD_SIZE set, but each process a
// world of one to MPI) are joined into one communicator, mpi_world(), through MPI's name service
// (Open MPI: `ompi-server`, named by OMPI_MCA_pmix_server_uri); `join_timeout` bounds the wait for
// the other ranks. Such a world talks over the network transport even within one machine.
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
            detail::joined_world = detail::join_singletons(launcher, join_timeout);
            joined_ = true;
        }
    }

    bool owner_ = false;
    bool joined_ = false;
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
// initialised without MpiSession, which would have joined them.
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
        if (launcher.world_size > 1 && (launcher.rank != place.rank || launcher.world_size != place.world_size))
            throw Error("gradsync: " + launcher.source + " say rank " + std::to_string(launcher.rank) + " of " +
                        std::to_string(launcher.world_size) + " but MPI says rank " + std::to_string(place.rank) +
                        " of " + std::to_string(place.world_size) +
                        ": these processes were not started by an MPI launcher, and MPI was initialised without "
                        "gradsync::MpiSession, which joins such processes. " +
                        detail::join_advice(launcher));
    }
    return place;
}

// How MpiBackend reduces.
enum class MpiAlgorithm : std::uint8_t {
    // ring for pieces of MpiOptions::ring_min and more, the MPI library's own allreduce below.
    automatic,
    // MPI_Allreduce in place, then a pass that divides by the number of ranks for an average.
    mpi_allreduce,
    // Our ring over point-to-point messages: reduce-scatter then all-gather, in place, with the
    // division for an average folded into the last reduction step, so the gradients are read and
    // written no more often than the reduction itself needs, and the only scratch memory is
    // persistent (one huge MPI_Allreduce page-faults on fresh temporaries at every call).
    ring,
};

struct MpiOptions {
    MpiAlgorithm algorithm = MpiAlgorithm::automatic;
    // A collective that has not completed by then ends the job (MPI_Abort) with a diagnosis.
    std::chrono::milliseconds timeout = std::chrono::seconds(600);
    // An allreduce runs in pieces of this size, so each piece is still in cache when it is
    // averaged, and scratch memory stays at this size over the number of ranks.
    Bytes chunk = Bytes{4u << 20};
    // `automatic` uses the ring for pieces of at least this size.
    Bytes ring_min = Bytes{256u << 10};
    // Segments smaller than this are packed together and reduced in one call: many small
    // tensors must not mean many collectives.
    Bytes pack_below = Bytes{64u << 10};
};

// Collectives of one MPI communicator (a duplicate of the one given, so that ours never match the
// program's own messages). Driven by one thread at a time, like every backend: DataParallel does.
// Construct and destroy it between MPI initialisation and finalisation (MpiSession does both).
class MpiBackend {
public:
    explicit MpiBackend(MPI_Comm comm = mpi_world(), MpiOptions options = {}) : options_(options) {
        int initialized = 0;
        MPI_Initialized(&initialized);
        if (!initialized)
            throw CollectiveError(
                "gradsync: MpiBackend created before MPI was initialised; create a gradsync::MpiSession first (or call "
                "MPI_Init_thread with MPI_THREAD_MULTIPLE)");
        level_ = detail::mpi_thread_level();
        if (level_ < MPI_THREAD_SERIALIZED)
            throw CollectiveError(std::string("gradsync: MPI was initialised with ") +
                                  detail::thread_level_name(level_) +
                                  "; MpiBackend needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (its progress "
                                  "thread calls MPI). Initialise with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
                                  "or gradsync::MpiSession.");
        if (options_.timeout <= std::chrono::milliseconds::zero())
            throw CollectiveError("gradsync: MpiOptions::timeout must be positive");
        check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
        MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);  // errors become exceptions, not exits
        MPI_Comm_rank(comm_, &rank_);
        MPI_Comm_size(comm_, &size_);
        MPI_Type_contiguous(2, MPI_BYTE, &half_type_);
        MPI_Type_commit(&half_type_);
        MPI_Op_create(&detail::mpi_sum_16<float16>, /*commute=*/1, &sum_f16_);
        MPI_Op_create(&detail::mpi_sum_16<bfloat16>, /*commute=*/1, &sum_bf16_);
        watchdog_ = std::thread([this] { watch(); });
    }
    MpiBackend(const MpiBackend&) = delete;
    MpiBackend& operator=(const MpiBackend&) = delete;
    ~MpiBackend() {
        async_.stop();  // drains: every queued collective ends, or the watchdog ends the job
        {
            std::lock_guard lock(watch_mutex_);
            stop_ = true;
        }
        watch_cv_.notify_one();
        watchdog_.join();
        MPI_Op_free(&sum_f16_);
        MPI_Op_free(&sum_bf16_);
        MPI_Type_free(&half_type_);
        MPI_Comm_free(&comm_);
    }

    [[nodiscard]] int rank() const { return rank_; }
    [[nodiscard]] int size() const { return size_; }
    [[nodiscard]] bool supports(DType t) const { return detail::reducible(t); }
    // The communicator the collectives run on (our duplicate), e.g. to bootstrap another library.
    [[nodiscard]] MPI_Comm communicator() const { return comm_; }
    [[nodiscard]] const MpiOptions& options() const { return options_; }

    void allreduce(Buffer buf, ReduceOp op) {
        const Segment seg{buf.data, buf.count};
        allreduce(std::span<const Segment>(&seg, 1), buf.dtype, op);
    }
    template <HasDType T>
    void allreduce(std::span<T> data, ReduceOp op) {
        allreduce(buffer_of(data), op);
    }
    CollectiveHandle allreduce_async(Buffer buf, ReduceOp op) {
        return launch(describe_allreduce(buf.count, buf.dtype, op), [this, buf, op] {
            const Segment seg{buf.data, buf.count};
            reduce_segments(std::span<const Segment>(&seg, 1), buf.dtype, op);
        });
    }

    // Reduces the segments where they lie: large ones in place, in chunks; small ones packed
    // together first. Every rank must pass segments of the same sizes in the same order.
    void allreduce(std::span<const Segment> segments, DType dtype, ReduceOp op) {
        check_dtype(dtype);
        run_now(describe_allreduce(detail::total_count(segments), dtype, op),
                [&] { reduce_segments(segments, dtype, op); });
    }
    // The segment list is copied; the memory it points to must stay untouched until completion.
    CollectiveHandle allreduce_async(std::span<const Segment> segments, DType dtype, ReduceOp op) {
        check_dtype(dtype);
        std::vector<Segment> copy(segments.begin(), segments.end());
        return launch(describe_allreduce(detail::total_count(segments), dtype, op),
                      [this, copy = std::move(copy), dtype, op] { reduce_segments(copy, dtype, op); });
    }

    void broadcast(std::span<std::byte> bytes, int root) {
        if (root < 0 || root >= size_)
            throw CollectiveError("gradsync: rank " + std::to_string(rank_) + ": broadcast from rank " +
                                  std::to_string(root) + " of a group of " + std::to_string(size_));
        const std::string what = "broadcast #" + std::to_string(++seq_) + " (" + std::to_string(bytes.size()) +
                                 " bytes from rank " + std::to_string(root) + ")";
        run_now(what, [&] {
            for (std::size_t off = 0; off < bytes.size(); off += INT_MAX) {
                const int n = static_cast<int>(std::min<std::size_t>(INT_MAX, bytes.size() - off));
                check(MPI_Bcast(bytes.data() + off, n, MPI_BYTE, root, comm_), "MPI_Bcast");
            }
        });
    }
    template <class T>
    requires std::is_trivially_copyable_v<T>
    void broadcast(std::span<T> data, int root) { broadcast(std::as_writable_bytes(data), root); }

    void barrier() {
        run_now("barrier #" + std::to_string(++seq_), [&] { check(MPI_Barrier(comm_), "MPI_Barrier"); });
    }

    // `reporter` says where this rank stands (DataParallel: step, bucket, missing gradients); the
    // watchdog quotes it when a collective misses its deadline. It runs on the watchdog thread.
    std::uint64_t add_status_reporter(std::function<std::string()> reporter) {
        std::lock_guard lock(reporters_mutex_);
        reporters_.emplace_back(++next_reporter_, std::move(reporter));
        return next_reporter_;
    }
    void remove_status_reporter(std::uint64_t id) {
        std::lock_guard lock(reporters_mutex_);
        std::erase_if(reporters_, [id](const auto& r) { return r.first == id; });
    }

    // Ends the whole job: prints `reason` with this rank's number, then MPI_Abort. Peers blocked
    // in collectives cannot be released any other way.
    [[noreturn]] void abort(const std::string& reason) {
        std::fprintf(stderr, "gradsync: rank %d aborts the job: %s\n", rank_, reason.c_str());
        std::fflush(stderr);
        end_job();
    }

private:
    void check(int rc, const char* call) const {
        if (rc != MPI_SUCCESS)
            throw CollectiveError("gradsync: rank " + std::to_string(rank_) + ": " + call +
                                  " failed: " + detail::mpi_error_string(rc));
    }

    void check_dtype(DType t) const {
        if (!supports(t))
            throw CollectiveError("gradsync: rank " + std::to_string(rank_) + ": MpiBackend cannot reduce " +
                                  to_string(t));
    }

    std::string describe_allreduce(std::size_t count, DType t, ReduceOp op) {
        return "allreduce #" + std::to_string(++seq_) + " (" + std::to_string(count) + " x " + to_string(t) + ", " +
               to_string(op) + ")";
    }

    [[nodiscard]] MPI_Datatype mpi_type(DType t) const {
        switch (t) {
            case DType::float64: return MPI_DOUBLE;
            case DType::float16:
            case DType::bfloat16: return half_type_;
            default: return MPI_FLOAT;
        }
    }
    [[nodiscard]] MPI_Op mpi_sum(DType t) const {
        if (t == DType::float16) return sum_f16_;
        if (t == DType::bfloat16) return sum_bf16_;
        return MPI_SUM;
    }

    // In place, `count` elements at `data`, in pieces of options_.chunk.
    void reduce_run(std::byte* data, std::size_t count, DType t, ReduceOp op) {
        const std::size_t elem = size_of(t);
        const std::size_t chunk =
            std::max<std::size_t>(1, std::min<std::size_t>(options_.chunk.count(), std::size_t{1} << 30) / elem);
        for (std::size_t off = 0; off < count; off += chunk) {
            const std::size_t k = std::min(chunk, count - off);
            std::byte* p = data + off * elem;
            const bool ring = options_.algorithm == MpiAlgorithm::ring ||
                              (options_.algorithm == MpiAlgorithm::automatic && k * elem >= options_.ring_min.count());
            if (ring && k >= std::size_t(size_)) {
                ring_allreduce(p, k, t, op);
            } else {
                check(MPI_Allreduce(MPI_IN_PLACE, p, static_cast<int>(k), mpi_type(t), mpi_sum(t), comm_),
                      "MPI_Allreduce");
                if (op == ReduceOp::average) average(p, k, t);
            }
        }
    }

    // Ring allreduce of `count` elements at `data`, in place. Part i of the n parts is summed
    // along the ring ending at rank i - 1 (mod n), which averages it in the same pass, and is then
    // passed around: every rank ends with the same bits.
    void ring_allreduce(std::byte* data, std::size_t count, DType t, ReduceOp op) {
        const int n = size_;
        const std::size_t elem = size_of(t);
        auto begin = [&](int part) { return count * std::size_t(part) / std::size_t(n); };
        auto length = [&](int part) { return begin(part + 1) - begin(part); };
        const std::size_t most = (count + std::size_t(n) - 1) / std::size_t(n);
        if (scratch_.size() < most * elem) scratch_.resize(most * elem);
        const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
        constexpr int tag = 0x6773;  // on our own communicator: no other messages to confuse it with
        for (int step = 0; step + 1 < n; ++step) {
            const int send = (rank_ - step + 2 * n) % n, recv = (rank_ - step - 1 + 2 * n) % n;
            check(MPI_Sendrecv(data + begin(send) * elem, static_cast<int>(length(send) * elem), MPI_BYTE, right, tag,
                               scratch_.data(), static_cast<int>(length(recv) * elem), MPI_BYTE, left, tag, comm_,
                               MPI_STATUS_IGNORE),
                  "MPI_Sendrecv");
            const bool last = step + 2 == n;
            detail::add_received(data + begin(recv) * elem, scratch_.data(), length(recv), t,
                                 last && op == ReduceOp::average ? 1.0 / n : 1.0);
        }
        for (int step = 0; step + 1 < n; ++step) {
            const int send = (rank_ + 1 - step + 2 * n) % n, recv = (rank_ - step + 2 * n) % n;
            check(MPI_Sendrecv(data + begin(send) * elem, static_cast<int>(length(send) * elem), MPI_BYTE, right, tag,
                               data + begin(recv) * elem, static_cast<int>(length(recv) * elem), MPI_BYTE, left, tag,
                               comm_, MPI_STATUS_IGNORE),
                  "MPI_Sendrecv");
        }
    }

    void average(std::byte* p, std::size_t k, DType t) const {
        switch (t) {
            case DType::float64: detail::scale_in_place(reinterpret_cast<double*>(p), 1.0 / size_, k); break;
            case DType::float16: detail::scale_16(reinterpret_cast<float16*>(p), 1.0f / float(size_), k); break;
            case DType::bfloat16: detail::scale_16(reinterpret_cast<bfloat16*>(p), 1.0f / float(size_), k); break;
            default: detail::scale_in_place(reinterpret_cast<float*>(p), 1.0f / float(size_), k); break;
        }
    }

    void reduce_segments(std::span<const Segment> segments, DType t, ReduceOp op) {
        if (size_ == 1) return;  // the sum and the average of one rank are its own values
        const std::size_t elem = size_of(t);
        const std::size_t small = options_.pack_below.count() / elem;
        std::size_t packed = 0;  // elements in staging_
        std::size_t first_small = 0;
        // Packs small segments [first_small, end) into staging_, reduces, and copies them back.
        auto flush = [&](std::size_t end) {
            if (packed == 0) return;
            reduce_run(staging_.data(), packed, t, op);
            std::size_t at = 0;
            for (std::size_t i = first_small; i < end; ++i) {
                const auto& s = segments[i];
                if (s.count >= small || s.count == 0) continue;
                std::memcpy(s.data, staging_.data() + at * elem, s.count * elem);
                at += s.count;
            }
            packed = 0;
        };
        for (std::size_t i = 0; i < segments.size(); ++i) {
            const auto& s = segments[i];
            if (s.count == 0) continue;
            if (s.count >= small) {
                reduce_run(static_cast<std::byte*>(s.data), s.count, t, op);
                continue;
            }
            if (packed == 0) first_small = i;
            if (staging_.size() < (packed + s.count) * elem)
                staging_.resize(std::max(options_.pack_below.count() * 4, (packed + s.count) * elem * 2));
            std::memcpy(staging_.data() + packed * elem, s.data, s.count * elem);
            packed += s.count;
            if (packed * elem >= options_.chunk.count()) flush(i + 1);
        }
        flush(segments.size());
    }

    // Runs a collective on this thread, after every asynchronous one launched before it.
    template <class F>
    void run_now(const std::string& what, F&& body) {
        async_.wait_for_all();
        guarded(what, body);
    }

    template <class F>
    CollectiveHandle launch(std::string what, F body) {
        auto done = std::make_shared<detail::Completion>();
        async_.launch([this, what = std::move(what), body = std::move(body)]() mutable { guarded(what, body); }, done);
        return CollectiveHandle(std::move(done));
    }

    // Runs one collective under the watchdog's eye.
    template <class F>
    void guarded(const std::string& what, F& body) {
        {
            std::lock_guard lock(watch_mutex_);
            current_ = what;
            deadline_ = std::chrono::steady_clock::now() + options_.timeout;
            busy_ = true;
        }
        struct Done {
            MpiBackend* self;
            ~Done() {
                std::lock_guard lock(self->watch_mutex_);
                self->busy_ = false;
            }
        } done{this};
        body();
    }

    // Wakes at the running collective's deadline, or one timeout from now when none runs: a
    // collective that starts meanwhile has a later deadline, so nothing on the collectives' path
    // ever needs to wake the watchdog (only the destructor does, to stop it).
    void watch() {
        std::unique_lock lock(watch_mutex_);
        while (!stop_) {
            const auto now = std::chrono::steady_clock::now();
            if (busy_ && now >= deadline_) {
                const std::string what = current_;
                lock.unlock();
                report_timeout(what);
                end_job();
            }
            watch_cv_.wait_until(lock, busy_ ? deadline_ : now + options_.timeout);
        }
    }

    void report_timeout(const std::string& what) {
        std::string where;
        {
            std::lock_guard reporters_lock(reporters_mutex_);
            for (const auto& r : reporters_) where += "; this rank is " + r.second();
        }
        const auto seconds = std::chrono::duration<double>(options_.timeout).count();
        std::fprintf(stderr,
                     "gradsync: rank %d of %d: %s has not completed after %.3g s (MpiOptions::timeout)%s. A peer rank "
                     "is late, has exited, or called a different collective; MPI cannot cancel a collective, so this "
                     "rank ends the job.\n",
                     rank_, size_, what.c_str(), seconds, where.c_str());
        std::fflush(stderr);
    }

    [[noreturn]] void end_job() {
        // MPI_Abort while another thread may be inside MPI is only allowed at MPI_THREAD_MULTIPLE;
        // below it, exiting without MPI_Finalize makes the launcher end the job just the same.
        if (level_ == MPI_THREAD_MULTIPLE) MPI_Abort(comm_, 1);
        std::_Exit(1);
    }

    MpiOptions options_;
    MPI_Comm comm_ = MPI_COMM_NULL;
    int rank_ = 0;
    int size_ = 1;
    int level_ = MPI_THREAD_SINGLE;
    MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
    MPI_Op sum_f16_ = MPI_OP_NULL;
    MPI_Op sum_bf16_ = MPI_OP_NULL;
    std::uint64_t seq_ = 0;
    std::vector<std::byte> staging_;  // small segments packed together; used by one collective at a time
    std::vector<std::byte> scratch_;  // the ring's received part; likewise

    std::mutex watch_mutex_;
    std::condition_variable watch_cv_;
    std::string current_;
    std::chrono::steady_clock::time_point deadline_;
    bool busy_ = false;
    bool stop_ = false;
    std::thread watchdog_;

    std::mutex reporters_mutex_;
    std::vector<std::pair<std::uint64_t, std::function<std::string()>>> reporters_;
    std::uint64_t next_reporter_ = 0;

    detail::AsyncCollectives async_;  // last: destroyed first, drained before the rest
};

}  // namespace gradsync::inline v0
