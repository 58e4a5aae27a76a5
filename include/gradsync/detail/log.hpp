// Rank-prefixed logging to stderr, with the level taken from GRADSYNC_LOG (info or debug).
#pragma once

#include <gradsync/version.hpp>

#include <cstdio>
#include <cstdlib>  // for std::getenv
#include <mutex>
#include <string>
#include <string_view>

namespace gradsync::inline v0::detail {

enum class LogLevel : int { off = 0, info = 1, debug = 2 };

inline LogLevel log_level() {
    static const LogLevel level = [] {
        const char* env = std::getenv("GRADSYNC_LOG");
        std::string_view v = env != nullptr ? env : "";
        if (v == "debug") return LogLevel::debug;
        if (v == "info") return LogLevel::info;
        return LogLevel::off;
    }();
    return level;
}

inline bool logging(LogLevel level) { return static_cast<int>(log_level()) >= static_cast<int>(level); }

// One line per call, "[gradsync rank 3] message"; lines of concurrent ranks never interleave.
inline void log(LogLevel level, int rank, const std::string& message) {
    if (!logging(level)) return;
    static std::mutex mutex;
    std::lock_guard lock(mutex);
    std::fprintf(stderr, "[gradsync rank %d] %s\n", rank, message.c_str());
}

}  // namespace gradsync::inline v0::detail
