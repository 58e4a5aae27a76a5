// Rank-prefixed logging, with the level taken from GRADSYNC_LOG (info or debug). Lines go to
// stderr, or with GRADSYNC_LOG_FILE=path one file per rank: "%r" in the path becomes the rank
// (logs/rank%r.log), and without "%r" the rank is appended (path.3).
#pragma once

#include <gradsync/version.hpp>

#include <algorithm>  // for std::min
#include <cstdio>
#include <cstdlib>  // for std::getenv
#include <map>
#include <mutex>
#include <string>
#include <type_traits>  // for std::is_invocable_r_v
#include <string_view>

namespace gradsync::inline v0::detail {

enum class LogLevel : int { off = 0, info = 1, debug = 2 };

struct LogSettings {
    LogLevel level = LogLevel::off;
    std::string file;  // empty: stderr
};

inline LogSettings settings_from_env() {
    LogSettings s;
    const char* level = std::getenv("GRADSYNC_LOG");
    std::string_view v = level != nullptr ? level : "";
    if (v == "debug") s.level = LogLevel::debug;
    if (v == "info") s.level = LogLevel::info;
    if (const char* file = std::getenv("GRADSYNC_LOG_FILE")) s.file = file;
    return s;
}

// Read once from the environment; tests may change it (between log calls of other threads).
inline LogSettings& log_settings() {
    static LogSettings settings = settings_from_env();
    return settings;
}

inline LogLevel log_level() { return log_settings().level; }

inline bool logging(LogLevel level) { return static_cast<int>(log_level()) >= static_cast<int>(level); }

inline std::string log_file_of(const std::string& pattern, int rank) {
    const auto at = pattern.find("%r");
    if (at == std::string::npos) return pattern + "." + std::to_string(rank);
    return pattern.substr(0, at) + std::to_string(rank) + pattern.substr(at + 2);
}

struct LogFiles {
    std::mutex mutex;
    std::map<std::string, std::FILE*> open;
    ~LogFiles() { close(); }
    void close() {
        for (auto& [path, f] : open)
            if (f != stderr) std::fclose(f);
        open.clear();
    }
};

inline LogFiles& log_files() {
    static LogFiles files;
    return files;
}

// "[gradsync rank 3] message", the prefix on every line; lines of concurrent ranks never interleave.
// A log file that cannot be opened falls back to stderr, saying so once.
inline void log(LogLevel level, int rank, const std::string& message) {
    if (!logging(level)) return;
    auto& files = log_files();
    std::lock_guard lock(files.mutex);
    std::FILE* out = stderr;
    const auto& pattern = log_settings().file;
    if (!pattern.empty()) {
        const auto path = log_file_of(pattern, rank);
        auto it = files.open.find(path);
        if (it == files.open.end()) {
            std::FILE* f = std::fopen(path.c_str(), "a");
            if (f == nullptr)
                std::fprintf(stderr, "[gradsync rank %d] cannot open log file %s; logging to stderr\n", rank,
                             path.c_str());
            it = files.open.emplace(path, f != nullptr ? f : stderr).first;
        }
        out = it->second;
    }
    std::size_t begin = 0;  // every line of a multi-line message carries the prefix
    do {
        const auto end = std::min(message.find('\n', begin), message.size());
        std::fprintf(out, "[gradsync rank %d] %.*s\n", rank, static_cast<int>(end - begin), message.data() + begin);
        begin = end + 1;
    } while (begin < message.size());
    std::fflush(out);
}

// The same, with the message made only when it will be written: make() returns it.
template <class Make>
requires std::is_invocable_r_v<std::string, Make&>
void log(LogLevel level, int rank, Make&& make) {
    if (logging(level)) log(level, rank, std::string(make()));
}

}  // namespace gradsync::inline v0::detail
