// nccl_spawn(n, fn): one process driving n GPUs, one thread per GPU, each thread rank r of an
// NCCL communicator on device r: the GPU counterpart of spawn() and of paddle.distributed.spawn.
// Not included by <gradsync/gradsync.hpp>: needs <nccl.h> and the CUDA runtime.
#pragma once

#include <gradsync/backend/nccl.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/error.hpp>

#include <exception>  // for std::exception_ptr, std::rethrow_exception
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>  // for std::is_invocable_v
#include <vector>

namespace gradsync::inline v0 {

// Calls fn(NcclBackend<Algo>&) on n threads, thread r as rank r on CUDA device r (current when fn
// runs), and joins them.
// The communicators are created by the threads themselves, each with ncclCommInitRankConfig on
// one unique id, rather than by ncclCommInitAll, whose communicators are blocking and so could
// not be aborted by a watchdog. When a rank throws, every other rank's communicator is aborted,
// so that peers blocked in collectives fail at once; after all threads have ended, the first
// exception (the cause, not the peers' resulting failures) is rethrown.
template <class Algo = nccl::Auto, class Fn>
requires std::is_invocable_v < const Fn&, NcclBackend<Algo>
& > void nccl_spawn(int n, const Fn& fn, NcclOptions options = {}) {
    const auto devices = cuda_devices();
    if (n < 1 || n > devices.count)
        throw Error("gradsync: nccl_spawn(" + std::to_string(n) + "): needs from 1 to " +
                    std::to_string(devices.count) + " ranks, one per visible CUDA device" +
                    (devices.count == 0 ? " (" + devices.why + ")" : std::string()));
    ncclUniqueId id{};
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
        throw CollectiveError("gradsync: nccl_spawn: ncclGetUniqueId failed: " + detail::nccl_words(r, nullptr));

    std::mutex mutex;
    std::exception_ptr first;
    std::vector<NcclBackend<Algo>*> live(static_cast<std::size_t>(n), nullptr);  // under mutex
    // In a catch handler: keeps the first exception and aborts every live rank, this one included.
    auto fail_all = [&](int culprit) {
        std::string what = "unknown exception";
        try {
            throw;
        } catch (const std::exception& e) {
            what = e.what();
        } catch (...) {
        }
        std::lock_guard lock(mutex);
        if (!first) first = std::current_exception();
        for (auto* backend : live)
            if (backend != nullptr) backend->abort("gradsync: rank " + std::to_string(culprit) + " threw: " + what);
    };
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            try {
                NcclBackend<Algo> backend(r, n, r, id, options);
                auto& slot = live[static_cast<std::size_t>(r)];
                {
                    std::lock_guard lock(mutex);
                    slot = &backend;
                    if (first)
                        backend.abort("gradsync: rank " + std::to_string(r) + " joined after another rank failed");
                }
                try {
                    fn(backend);
                } catch (...) {
                    fail_all(r);  // before the backend is destroyed: its communicator is aborted, not flushed
                }
                std::lock_guard lock(mutex);
                slot = nullptr;
            } catch (...) {
                fail_all(r);  // could not join
            }
        });
    }
    for (auto& t : threads) t.join();
    if (first) std::rethrow_exception(first);
}

}  // namespace gradsync::inline v0
