// A POSIX file descriptor that closes itself: a file the checkpoint writer opened, a socket the
// MPI name server's announcer listens on.
#pragma once

#include <gradsync/version.hpp>

#include <fcntl.h>   // for open
#include <unistd.h>  // for close

#include <filesystem>
#include <utility>  // for std::exchange

namespace gradsync::inline v0::detail {

class FileDescriptor {
public:
    FileDescriptor() = default;
    explicit FileDescriptor(int fd) : fd_(fd) {}
    // Opens `path` close-on-exec (a file it creates gets mode 0644); is_open() says whether it did.
    FileDescriptor(const std::filesystem::path& path, int flags) : fd_(::open(path.c_str(), flags | O_CLOEXEC, 0644)) {}
    FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
    FileDescriptor& operator=(FileDescriptor&& other) noexcept {
        if (this != &other) {
            reset();
            fd_ = std::exchange(other.fd_, -1);
        }
        return *this;
    }
    FileDescriptor(const FileDescriptor&) = delete;
    FileDescriptor& operator=(const FileDescriptor&) = delete;
    ~FileDescriptor() { reset(); }

    [[nodiscard]] int fd() const { return fd_; }
    [[nodiscard]] bool is_open() const { return fd_ >= 0; }
    void reset() {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }
    // Closes now, reporting the error close() may have kept from an earlier write.
    bool close() { return ::close(std::exchange(fd_, -1)) == 0; }

private:
    int fd_ = -1;
};

}  // namespace gradsync::inline v0::detail
