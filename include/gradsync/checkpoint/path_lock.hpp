// Saves and loads of one checkpoint path that lists files beside it (shard files, rank files) take
// turns through a lock file, `<checkpoint>.lock`: a save holds it alone from its first file to the
// removal of earlier saves' files, a load shares it while it reads. Without it, two trainers
// saving one path remove each other's new files, and a load meets files a save has just removed.
// flock(2): held per open file (so two threads of one process exclude each other too), released
// when the process dies, never left stale. The lock file stays.
#pragma once

#include <gradsync/checkpoint/safetensors.hpp>  // for CheckpointError

#include <fcntl.h>     // for open
#include <sys/file.h>  // for flock
#include <unistd.h>    // for close

#include <cerrno>
#include <chrono>
#include <cstring>  // for std::strerror
#include <filesystem>
#include <string>
#include <thread>  // for std::this_thread::sleep_for

namespace gradsync::inline v0::detail {

inline std::filesystem::path lock_path_of(const std::filesystem::path& checkpoint) {
    auto out = checkpoint;
    out += ".lock";
    return out;
}

class PathLock {
public:
    enum class Mode { shared, exclusive };

    PathLock() = default;
    // Takes the lock of `checkpoint` in `mode`, waiting up to `wait` for another holder; throws a
    // CheckpointError saying who else may hold it after that, or when the lock file cannot be made.
    PathLock(const std::filesystem::path& checkpoint, Mode mode, std::chrono::milliseconds wait) {
        const auto path = lock_path_of(checkpoint);
        fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd_ < 0)
            throw CheckpointError("gradsync: checkpoint " + checkpoint.string() + ": cannot open its lock file " +
                                  path.string() + ": " + std::strerror(errno));
        const int op = (mode == Mode::shared ? LOCK_SH : LOCK_EX) | LOCK_NB;
        const auto deadline = std::chrono::steady_clock::now() + wait;
        while (::flock(fd_, op) != 0) {
            const int error = errno;
            if ((error != EWOULDBLOCK && error != EINTR) || std::chrono::steady_clock::now() >= deadline) {
                release();
                throw CheckpointError(
                    "gradsync: checkpoint " + checkpoint.string() + ": " +
                    (error == EWOULDBLOCK
                         ? "another save or load of this path held its lock (" + path.string() + ") for " +
                               std::to_string(wait.count()) +
                               " ms; is another trainer saving to the same path? (Checkpoint::Options::lock_wait)"
                         : "cannot lock " + path.string() + ": " + std::strerror(error)));
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
    }
    PathLock(PathLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
    PathLock& operator=(PathLock&& other) noexcept {
        if (this != &other) {
            release();
            fd_ = other.fd_;
            other.fd_ = -1;
        }
        return *this;
    }
    PathLock(const PathLock&) = delete;
    PathLock& operator=(const PathLock&) = delete;
    ~PathLock() { release(); }

    [[nodiscard]] bool held() const { return fd_ >= 0; }

private:
    void release() noexcept {
        if (fd_ >= 0) ::close(fd_);  // closing the file releases its lock
        fd_ = -1;
    }
    int fd_ = -1;
};

}  // namespace gradsync::inline v0::detail
