// The memory a SharedMemoryBackend group shares: one POSIX shared-memory object that every rank
// maps, wherever its process is. It holds a header (the group's shape and its abort), one
// control block per rank (how far that rank has come, its current call, whether it is alive)
// and one pair of staging slots per rank. Every rank computes the same layout from the group's
// size and slot size, so nothing in it is a pointer: each process maps it at its own address.
//
// Rank 0 creates the object and the others open it by name; once every rank has mapped it, the
// name is removed, so a job that crashes later leaves nothing in /dev/shm.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/detail/wait.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::max
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>  // for std::strerror, std::memcpy
#include <new>      // for placement new
#include <string>

#include <fcntl.h>  // for O_CREAT, O_EXCL, O_RDWR
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>  // for ftruncate, close, getpid

namespace gradsync::inline v0::detail {

static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::int32_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free to work across processes");

// A collective as the ranks compare it: CollectiveCall in plain fields, copyable into shared memory.
struct SharedCall {
    std::uint64_t seq = 0, count = 0, fingerprint = 0;
    std::int64_t step = -1;
    std::int32_t bucket = -1, root = 0;
    std::uint8_t kind = 0, op = 0, has_dtype = 0, dtype = 0;

    static SharedCall of(const CollectiveCall& c) {
        return {c.seq,
                c.count,
                c.tag.fingerprint,
                c.tag.step,
                c.tag.bucket,
                c.root,
                std::uint8_t(c.kind),
                std::uint8_t(c.op),
                std::uint8_t(c.dtype.has_value()),
                std::uint8_t(c.dtype ? *c.dtype : DType{})};
    }
    [[nodiscard]] CollectiveCall call() const {
        CollectiveCall c;
        c.kind = CollectiveKind(kind);
        c.seq = seq;
        c.count = count;
        if (has_dtype != 0) c.dtype = DType(dtype);
        c.op = ReduceOp(op);
        c.root = root;
        c.tag = CollectiveTag{fingerprint, step, bucket};
        return c;
    }
};

inline constexpr std::size_t shared_line = 64;

struct alignas(shared_line) SharedHeader {
    static constexpr std::uint64_t magic_value = 0x636e7973'64617267;  // "gradsync"
    std::atomic<std::uint64_t> magic{0};                               // set last by the creator: the rest is ready
    std::int32_t size = 0;
    std::uint64_t slot_bytes = 0;
    std::atomic<std::int32_t> attached{0};
    std::atomic<std::int32_t> aborted{0};  // 0, 1 while the reason is written, 2 once it is
    char reason[1024] = {};
};

struct alignas(shared_line) SharedRank {
    std::atomic<std::uint64_t> stage{0};  // meetings this rank has arrived at
    alignas(shared_line) std::atomic<std::int32_t> pid{0};
    std::atomic<std::uint64_t> pid_namespace{0};  // its pid means something only in this one
    std::atomic<std::int32_t> departed{0};
    SharedCall calls[2];  // the current collective, by the parity of its number
};

// One rank's mapping of the group's shared-memory object.
class SharedSegment {
public:
    SharedSegment(const std::string& name, int rank, int size, std::size_t slot_bytes,
                  std::chrono::milliseconds timeout)
        : name_(name), rank_(rank), size_(size), slot_bytes_(slot_bytes), bytes_(layout_bytes(size, slot_bytes)) {
        const auto deadline = deadline_after(timeout);
        const std::size_t expected = bytes_;
        const int fd = rank == 0 ? create() : open_existing(deadline);  // a joiner maps what it finds
        void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        const int mmap_errno = errno;
        ::close(fd);
        if (p == MAP_FAILED) {
            if (rank == 0) ::shm_unlink(name.c_str());
            throw CollectiveError(who() + ": cannot map shared memory " + name + ": " + std::strerror(mmap_errno));
        }
        base_ = static_cast<std::byte*>(p);
        if (rank == 0) {
            auto* h = new (base_) SharedHeader{};
            h->size = size;
            h->slot_bytes = slot_bytes;
            for (int r = 0; r < size; ++r) new (base_ + rank_offset(r)) SharedRank{};
            h->magic.store(SharedHeader::magic_value, std::memory_order_release);
        } else {
            wait_for(deadline, "rank 0 to set up shared memory " + name,
                     [&] { return header().magic.load(std::memory_order_acquire) == SharedHeader::magic_value; });
            const auto their_size = header().size;
            const auto their_slot = header().slot_bytes;
            if (their_size != size || their_slot != slot_bytes || bytes_ != expected) {
                unmap();
                throw CollectiveError(who() + ": shared memory " + name + " belongs to a group of " +
                                      std::to_string(their_size) + " ranks with slots of " +
                                      std::to_string(their_slot) + " bytes; this rank expects " + std::to_string(size) +
                                      " and " + std::to_string(slot_bytes) +
                                      ": every rank must pass the same size and options");
            }
        }
        me().pid.store(static_cast<std::int32_t>(::getpid()), std::memory_order_relaxed);
        me().pid_namespace.store(pid_namespace(), std::memory_order_relaxed);
        // The last rank to arrive removes the name: from then on the object lives only while mapped.
        if (header().attached.fetch_add(1, std::memory_order_acq_rel) + 1 == size) ::shm_unlink(name.c_str());
        try {
            wait_for(deadline, "every rank to map shared memory " + name,
                     [&] { return header().attached.load(std::memory_order_acquire) == size; });
        } catch (...) {
            if (rank == 0) ::shm_unlink(name.c_str());
            unmap();
            throw;
        }
    }
    SharedSegment(const SharedSegment&) = delete;
    SharedSegment& operator=(const SharedSegment&) = delete;
    ~SharedSegment() { unmap(); }

    [[nodiscard]] int rank() const { return rank_; }
    [[nodiscard]] int size() const { return size_; }
    [[nodiscard]] const std::string& name() const { return name_; }
    [[nodiscard]] std::size_t slot_bytes() const { return slot_bytes_; }
    [[nodiscard]] std::size_t mapped_bytes() const { return bytes_; }
    [[nodiscard]] SharedHeader& header() const { return *reinterpret_cast<SharedHeader*>(base_); }
    [[nodiscard]] SharedRank& rank_state(int r) const { return *reinterpret_cast<SharedRank*>(base_ + rank_offset(r)); }
    [[nodiscard]] SharedRank& me() const { return rank_state(rank_); }
    // Rank r's staging slot of parity p.
    [[nodiscard]] std::byte* slot(int r, unsigned p) const {
        return base_ + slots_offset(size_) + (static_cast<std::size_t>(r) * 2 + p) * slot_bytes_;
    }
    [[nodiscard]] std::string who() const { return rank_prefix(rank_, size_, "shared memory"); }

    // Which process-id namespace this process lives in (0 where /proc cannot tell): processes in
    // containers may share /dev/shm and not their process ids.
    static std::uint64_t pid_namespace() {
        struct stat st {};
        return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
    }

private:
    static std::size_t round_up(std::size_t n) { return (n + shared_line - 1) / shared_line * shared_line; }
    static std::size_t rank_offset(int r) {
        return round_up(sizeof(SharedHeader)) + static_cast<std::size_t>(r) * round_up(sizeof(SharedRank));
    }
    static std::size_t slots_offset(int size) { return (rank_offset(size) + 4095) / 4096 * 4096; }
    static std::size_t layout_bytes(int size, std::size_t slot_bytes) {
        return slots_offset(size) + static_cast<std::size_t>(size) * 2 * slot_bytes;
    }

    int create() {
        const int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0) {
            const int e = errno;
            throw CollectiveError(
                who() + ": cannot create shared memory " + name_ + ": " + std::strerror(e) +
                (e == EEXIST ? " (another group uses this name, or a job that crashed while its ranks were still "
                               "joining left it: give each job its own name, or remove /dev/shm" +
                                   name_ + ")"
                             : std::string()));
        }
        if (::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
            const int e = errno;
            ::close(fd);
            ::shm_unlink(name_.c_str());
            throw CollectiveError(who() + ": cannot size shared memory " + name_ + " to " + std::to_string(bytes_) +
                                  " bytes: " + std::strerror(e));
        }
        return fd;
    }

    int open_existing(std::chrono::steady_clock::time_point deadline) {
        int fd = -1;
        wait_for(deadline, "rank 0 to create shared memory " + name_, [&] {
            fd = ::shm_open(name_.c_str(), O_RDWR, 0600);
            if (fd >= 0) return true;
            if (errno != ENOENT)
                throw CollectiveError(who() + ": cannot open shared memory " + name_ + ": " + std::strerror(errno));
            return false;
        });
        // Rank 0 sizes the object just after creating it; what it finds is checked once mapped.
        try {
            wait_for(deadline, "rank 0 to size shared memory " + name_, [&] {
                struct stat st {};
                if (::fstat(fd, &st) != 0 || st.st_size <= 0) return false;
                bytes_ = std::max(static_cast<std::size_t>(st.st_size), sizeof(SharedHeader));
                return true;
            });
        } catch (...) {
            ::close(fd);
            throw;
        }
        return fd;
    }

    template <class Ready>
    void wait_for(std::chrono::steady_clock::time_point deadline, const std::string& what, Ready ready) const {
        SpinBudget spin;
        wait_until(
            ready,
            [&] {
                if (std::chrono::steady_clock::now() >= deadline)
                    throw TimeoutError(who() + ": timed out waiting for " + what +
                                       ": every rank of the group must construct its SharedMemoryBackend with the "
                                       "same name and size");
            },
            Nap(std::chrono::microseconds(200)), spin);
    }

    void unmap() {
        if (base_ != nullptr) ::munmap(base_, bytes_);
        base_ = nullptr;
    }

    std::string name_;
    int rank_, size_;
    std::size_t slot_bytes_, bytes_;
    std::byte* base_ = nullptr;
};

}  // namespace gradsync::inline v0::detail
