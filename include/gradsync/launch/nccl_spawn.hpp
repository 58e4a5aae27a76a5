// nccl_spawn(n, fn): one process driving n GPUs, one thread per GPU, each thread rank r of an
// NCCL communicator on device r: the GPU counterpart of spawn() and of paddle.distributed.spawn.
// Not included by <gradsync/gradsync.hpp>: needs <nccl.h> and the CUDA runtime.
#pragma once

#include <gradsync/backend/nccl.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/detail/first_error.hpp>
#include <gradsync/error.hpp>

#include <stop_token>
#include <string>
#include <thread>
#include <type_traits>  // for std::is_invocable_v
#include <vector>

namespace gradsync::inline v0 {

// Calls fn(NcclBackend<Algo>&) on n threads, thread r as rank r on CUDA device r (current when fn
// runs), and joins them.
// The communicators are created by the threads themselves, each with ncclCommInitRankConfig on
// one unique id, rather than by ncclCommInitAll, whose communicators are blocking and so could
// not be aborted by a watchdog. When a rank throws, every other rank's communicator is aborted
// (through NcclOptions::stop, so even a rank still joining stops waiting), and peers blocked in
// collectives fail at once; after all threads have ended, the first exception (the cause, not
// the peers' resulting failures) is rethrown. A stop requested through options.stop ends every
// rank the same way.
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

    detail::FirstError errors;
    std::stop_source stop;
    // The caller's own stop request reaches every rank too.
    const auto forward = [&stop]() noexcept { stop.request_stop(); };
    std::stop_callback<decltype(forward)> caller(options.stop, forward);
    options.stop = stop.get_token();
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            try {
                NcclBackend<Algo> backend(r, n, r, id, options);
                try {
                    fn(backend);
                } catch (...) {
                    // Before the backend is destroyed: its communicator is aborted, not flushed.
                    errors.keep_current();
                    stop.request_stop();
                }
            } catch (...) {  // could not join
                errors.keep_current();
                stop.request_stop();
            }
        });
    }
    for (auto& t : threads) t.join();
    errors.rethrow_if_any();
}

}  // namespace gradsync::inline v0
