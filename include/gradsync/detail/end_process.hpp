// Ending the whole process from any thread, once. Deadlines on several threads (two backends'
// watchers, a watcher and the trainer) can fire together; a second MPI_Abort while the first is
// under way has crashed inside Open MPI. The first caller ends the process; any other waits for
// that instead of ending it again.
#pragma once

#include <gradsync/version.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>  // for std::_Exit
#include <thread>

namespace gradsync::inline v0::detail {

// One flag for the whole process (a function template's static would be one per caller).
inline std::atomic<bool>& process_ending() {
    static std::atomic<bool> ending{false};
    return ending;
}

// The first caller runs end() (MPI_Abort, say), then exits with status 1 should end() return;
// later callers wait for the process to end.
template <class End>
[[noreturn]] void end_process_once(End&& end) {
    if (!process_ending().exchange(true, std::memory_order_acq_rel)) {
        end();
        std::_Exit(1);
    }
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace gradsync::inline v0::detail
