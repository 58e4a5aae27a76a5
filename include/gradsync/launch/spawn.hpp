// spawn(n, fn): runs fn(backend) for each rank of a new LocalBackend group on n threads, the
// in-process counterpart of paddle.distributed.spawn.
#pragma once

#include <gradsync/backend/local.hpp>
#include <gradsync/detail/first_error.hpp>
#include <gradsync/error.hpp>

#include <string>
#include <thread>
#include <type_traits>  // for std::is_invocable_v
#include <utility>      // for std::move
#include <vector>

namespace gradsync::inline v0 {

// Calls fn(LocalBackend&) once per rank, each on its own thread, and joins them. The threads
// share one fn, called as const, so a mutable lambda (state shared without a lock) does not
// compile. When a rank throws, the group is aborted so that peers blocked in collectives fail at
// once instead of waiting; after every thread has ended, the first exception thrown (the cause,
// not the peers' resulting failures) is rethrown. A rank whose fn returns leaves the group: peers
// that still wait for it in a collective fail rather than hang.
template <class Fn>
requires std::is_invocable_v<const Fn&, LocalBackend&>
void spawn(int n, const Fn& fn, LocalGroupOptions options = {}) {
    auto ranks = LocalBackend::create_group(n, options);
    detail::FirstError errors;
    std::vector<std::thread> threads;
    threads.reserve(ranks.size());
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r, backend = std::move(ranks[static_cast<std::size_t>(r)])]() mutable {
            try {
                fn(backend);
            } catch (...) {
                backend.abort("rank " + std::to_string(r) + " threw: " + errors.keep_current());
            }
            LocalBackend leaving = std::move(backend);  // leaves the group at the end of this scope
        });
    }
    for (auto& t : threads) t.join();
    errors.rethrow_if_any();
}

}  // namespace gradsync::inline v0
