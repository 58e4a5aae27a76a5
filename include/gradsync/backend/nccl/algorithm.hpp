// The allreduce algorithm of an NCCL communicator (nccl::Auto, Ring, Tree), and the scope that
// sets NCCL_ALGO while communicators of one choice initialize. Needs <nccl.h>.
#pragma once

#include <gradsync/error.hpp>

#include <condition_variable>
#include <cstdlib>  // for std::getenv, setenv, unsetenv
#include <mutex>
#include <optional>
#include <string>

namespace gradsync::inline v0 {

// The allreduce algorithm of a communicator: NcclBackend<nccl::Ring>. NCCL has no per-communicator
// setting for it; it reads NCCL_ALGO (uncached, through ncclGetEnv) while it tunes a communicator
// at initialization. NcclBackend therefore sets NCCL_ALGO to "allreduce:ring" or "allreduce:tree"
// for the span of its own initialization, and restores it after; communicators of the process
// that initialize with another choice wait meanwhile, so each keeps its own. Auto leaves
// NCCL_ALGO as the user set it.
namespace nccl {
struct Auto {
    static constexpr const char* allreduce = nullptr;
};
struct Ring {
    static constexpr const char* allreduce = "allreduce:ring";
};
struct Tree {
    static constexpr const char* allreduce = "allreduce:tree";
};
}  // namespace nccl

namespace detail {

// Who is initializing communicators now, and with which NCCL_ALGO: any number with the same
// value at once (the ranks of one nccl_spawn must join together), one value at a time.
struct NcclAlgoScopes {
    std::mutex mutex;
    std::condition_variable cv;
    int holders = 0;
    std::optional<std::string> current;  // the value wanted; none: the user's own environment
    std::optional<std::string> before;   // the user's NCCL_ALGO, to restore
    bool changed = false;                // NCCL_ALGO was set, and must be restored

    static NcclAlgoScopes& instance() {
        static NcclAlgoScopes scopes;
        return scopes;
    }
};

// Sets NCCL_ALGO to `algo` while it lives (null: leaves the user's value), once no communicator
// of the process is initializing with another value, and restores it after the last scope of
// this value ends, so that no communicator sees another's choice. Writing the environment races
// with any thread reading it (NCCL's own threads read it through getenv), so the window is only
// the communicator's initialization, and nothing is written when NCCL_ALGO already holds the
// value. The rule for a process: create communicators of different algorithms one after the
// other, and do not write the environment from other threads meanwhile.
class ScopedNcclAlgo {
public:
    explicit ScopedNcclAlgo(const char* algo) {
        auto& scopes = NcclAlgoScopes::instance();
        std::unique_lock lock(scopes.mutex);
        std::optional<std::string> wanted;
        if (algo != nullptr) wanted = algo;
        scopes.cv.wait(lock, [&] { return scopes.holders == 0 || scopes.current == wanted; });
        if (scopes.holders == 0) {
            scopes.current = wanted;
            scopes.changed = false;
            scopes.before.reset();
            if (const char* before = std::getenv("NCCL_ALGO")) scopes.before = before;
            if (wanted && scopes.before != wanted) {
                if (::setenv("NCCL_ALGO", algo, 1) != 0) throw Error("gradsync: cannot set NCCL_ALGO");
                scopes.changed = true;
            }
        }
        ++scopes.holders;
    }
    ScopedNcclAlgo(const ScopedNcclAlgo&) = delete;
    ScopedNcclAlgo& operator=(const ScopedNcclAlgo&) = delete;
    ~ScopedNcclAlgo() {
        auto& scopes = NcclAlgoScopes::instance();
        std::lock_guard lock(scopes.mutex);
        if (--scopes.holders != 0) return;
        if (scopes.changed) {
            if (scopes.before)
                ::setenv("NCCL_ALGO", scopes.before->c_str(), 1);
            else
                ::unsetenv("NCCL_ALGO");
        }
        scopes.changed = false;
        scopes.current.reset();
        scopes.cv.notify_all();
    }
};

}  // namespace detail

}  // namespace gradsync::inline v0
