// The collectives of a SharedMemoryBackend rank, over the group's shared segment. A collective
// runs in chunks of one staging slot. An allreduce's chunk: each rank copies its chunk into its
// own slot, the ranks meet, each sums its 1/n piece of the chunk over every rank's slot (rank 0
// first, as LocalBackend does, so results are bitwise LocalBackend's) into its own slot, the
// ranks meet again, and each copies every piece from its owner's slot into its own memory (a
// reduce_scatter: the pieces in its shard). Each rank thus reads and writes its own memory once,
// and the slots, a few hundred KiB, stay in cache. A broadcast's or an all_gather's chunk: the
// giving ranks copy in, one meeting, the others copy out. Two slots per rank alternate, so that
// the next chunk's copy-in needs no meeting of its own.
//
// A rank that fails a collective (a peer gone, a deadline missed, calls that differ) aborts the
// group: every rank's pending and later collectives fail with that reason.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/detail/segment_cursor.hpp>
#include <gradsync/backend/detail/shared_segment.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/detail/aligned_bytes.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/detail/host_reduce.hpp>
#include <gradsync/detail/wait.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::min
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>  // for std::memcpy
#include <span>
#include <string>
#include <thread>  // for std::this_thread::sleep_for
#include <vector>

#include <signal.h>  // for kill

namespace gradsync::inline v0::detail {

// One collective of this rank: what every rank's must equal, and the memory it works on.
struct SharedCollective {
    CollectiveCall call;
    std::span<const Segment> segments;
};

// Copies n elements between a contiguous buffer and a list of segments, from element `start`.
inline void gather_segments(std::span<const Segment> segs, std::size_t start, std::size_t n, std::size_t elem,
                            std::byte* out) {
    SegmentCursor c(segs, start, elem);
    while (n > 0) {
        const std::size_t k = std::min(n, c.left());
        std::memcpy(out, c.ptr(), k * elem);
        out += k * elem;
        n -= k;
        c.advance(k);
    }
}
inline void scatter_segments(std::span<const Segment> segs, std::size_t start, std::size_t n, std::size_t elem,
                             const std::byte* in) {
    SegmentCursor c(segs, start, elem);
    while (n > 0) {
        const std::size_t k = std::min(n, c.left());
        std::memcpy(c.ptr(), in, k * elem);
        in += k * elem;
        n -= k;
        c.advance(k);
    }
}

class SharedGroup {
public:
    SharedGroup(const std::string& name, int rank, int size, std::size_t slot_bytes, std::chrono::milliseconds timeout)
        : segment_(name, rank, size, slot_bytes, timeout), timeout_(timeout), block_(reduce_block_bytes) {}

    [[nodiscard]] const SharedSegment& segment() const { return segment_; }

    void execute(const SharedCollective& c) {
        try {
            throw_if_aborted(c.call);
            run(c);
        } catch (const std::exception& e) {
            abort(e.what());
            throw;
        }
    }

    // Fails every pending and later collective of every rank with `reason`. First reason wins.
    void abort(const std::string& reason) {
        auto& h = segment_.header();
        std::int32_t expected = 0;
        if (!h.aborted.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return;
        const std::size_t n = std::min(reason.size(), sizeof(h.reason) - 1);
        std::memcpy(h.reason, reason.data(), n);
        h.reason[n] = '\0';
        h.aborted.store(2, std::memory_order_release);
    }
    [[nodiscard]] bool aborted() const { return segment_.header().aborted.load(std::memory_order_acquire) != 0; }
    void throw_if_aborted(const CollectiveCall& call) const {
        if (aborted())
            throw CollectiveError(segment_.who() + ": " + call.describe() + ": the group was aborted: " + reason());
    }
    [[nodiscard]] std::string reason() const {
        const auto& h = segment_.header();
        for (int i = 0; i < 1000 && h.aborted.load(std::memory_order_acquire) != 2; ++i)
            std::this_thread::sleep_for(std::chrono::microseconds(10));
        return h.aborted.load(std::memory_order_acquire) == 2 ? std::string(h.reason) : "(no reason given yet)";
    }

    // This rank's handle is gone: peers waiting for it fail at once.
    void depart() { segment_.me().departed.store(1, std::memory_order_release); }

private:
    void run(const SharedCollective& c) {
        const auto deadline = deadline_after(timeout_);
        const int n = segment_.size();
        segment_.me().calls[c.call.seq & 1] = SharedCall::of(c.call);
        if (c.call.kind == CollectiveKind::broadcast && (c.call.root < 0 || c.call.root >= n))
            throw CollectiveError(segment_.who() + ": " + c.call.describe() + ": root " + std::to_string(c.call.root) +
                                  " is not a rank of this group of " + std::to_string(n));
        const bool reduces = c.call.kind == CollectiveKind::allreduce || c.call.kind == CollectiveKind::reduce_scatter;
        if (reduces && !reducible(*c.call.dtype))
            throw CollectiveError(segment_.who() + ": " + c.call.describe() +
                                  ": SharedMemoryBackend reduces floating-point types only");
        if (n == 1) return;       // alone: every collective leaves the buffer as it is
        if (c.call.count == 0) {  // a barrier, or an empty call: one meeting, which checks the calls
            meet(c.call, deadline);
            return validate(c.call);
        }
        const std::size_t elem = c.call.dtype ? size_of(*c.call.dtype) : 1;
        const std::size_t per_chunk = segment_.slot_bytes() / elem;
        for (std::size_t off = 0; off < c.call.count; off += per_chunk) {
            const std::size_t m = std::min(per_chunk, c.call.count - off);
            const unsigned p = chunk_++ & 1;
            if (reduces)
                visit_float_dtype(*c.call.dtype,
                                  [&]<class T>(type_tag<T>) { reduce_chunk<T>(c, off, m, p, deadline); });
            else
                copy_chunk(c, off, m, elem, p, deadline);
        }
    }

    // The first meeting of a chunk, after each rank copied its part into its slot; the calls are
    // checked at the first chunk's (a copy-in before it touches only the rank's own free slot).
    // Slot p is written again two chunks later, after the next chunk's first meeting, which every
    // rank reaches only once done reading this chunk's slots.
    void meet_copied_in(const SharedCollective& c, std::size_t off, std::chrono::steady_clock::time_point deadline) {
        meet(c.call, deadline);
        if (off == 0) validate(c.call);
    }

    // Where [from, to) (elements of the call) meets the chunk [off, off + m), relative to the chunk.
    static Shard overlap(std::size_t off, std::size_t m, std::size_t from, std::size_t to) {
        const std::size_t a = std::max(from, off), b = std::min(to, off + m);
        return a < b ? Shard{a - off, b - a} : Shard{0, 0};
    }

    // The chunk [off, off + m) of an allreduce or a reduce_scatter, through the slots of parity p:
    // each rank sums its 1/n piece of the chunk into its own slot, then copies out every piece it
    // needs (all of them, or those in its shard) from their owners' slots.
    template <class T>
    void reduce_chunk(const SharedCollective& c, std::size_t off, std::size_t m, unsigned p,
                      std::chrono::steady_clock::time_point deadline) {
        const int n = segment_.size(), r = segment_.rank();
        gather_segments(c.segments, off, m, sizeof(T), segment_.slot(r, p));
        meet_copied_in(c, off, deadline);
        const auto piece = shard_of(m, n, r);
        inputs_.resize(static_cast<std::size_t>(n));
        for (int s = 0; s < n; ++s) inputs_[std::size_t(s)] = reinterpret_cast<T*>(segment_.slot(s, p)) + piece.offset;
        T* out = static_cast<T*>(inputs_[std::size_t(r)]);
        using A = accumulator_t<T>;
        reduce_to_all<T>(reinterpret_cast<T* const*>(inputs_.data()), n, &out, 1, piece.count,
                         c.call.op == ReduceOp::average, A(1) / static_cast<A>(n), block_.data());
        meet(c.call, deadline);
        // No streaming stores here (unlike LocalBackend's all_gather): this chunk of the rank's
        // memory was just read by the copy-in, so its lines are in cache (2 processes, ResNet-50's
        // 97.5 MiB in one buffer: 22 ms with them, 16 without).
        const Shard wanted = c.call.kind == CollectiveKind::allreduce ? Shard{0, m} : [&] {
            const auto mine = shard_of(c.call.count, n, r);
            return overlap(off, m, mine.offset, mine.offset + mine.count);
        }();
        for (int s = 0; s < n; ++s) {
            const auto theirs = shard_of(m, n, s);
            const auto part = overlap(0, m, std::max(theirs.offset, wanted.offset),
                                      std::min(theirs.offset + theirs.count, wanted.offset + wanted.count));
            if (part.count != 0)
                scatter_segments(c.segments, off + part.offset, part.count, sizeof(T),
                                 segment_.slot(s, p) + part.offset * sizeof(T));
        }
    }

    // The chunk [off, off + m) of a broadcast (the root's bytes) or an all_gather (each rank's
    // shard): each rank copies what it gives into its slot, then, after one meeting, what it takes
    // from the others' slots.
    void copy_chunk(const SharedCollective& c, std::size_t off, std::size_t m, std::size_t elem, unsigned p,
                    std::chrono::steady_clock::time_point deadline) {
        const int n = segment_.size();
        auto given = [&](int s) {
            if (c.call.kind == CollectiveKind::broadcast) return s == c.call.root ? Shard{0, m} : Shard{0, 0};
            const auto shard = shard_of(c.call.count, n, s);
            return overlap(off, m, shard.offset, shard.offset + shard.count);
        };
        const auto mine = given(segment_.rank());
        if (mine.count != 0)
            gather_segments(c.segments, off + mine.offset, mine.count, elem,
                            segment_.slot(segment_.rank(), p) + mine.offset * elem);
        meet_copied_in(c, off, deadline);
        for (int s = 0; s < n; ++s) {
            const auto theirs = given(s);
            if (s != segment_.rank() && theirs.count != 0)
                scatter_segments(c.segments, off + theirs.offset, theirs.count, elem,
                                 segment_.slot(s, p) + theirs.offset * elem);
        }
    }

    // Arrives at the next meeting and waits until every rank has.
    void meet(const CollectiveCall& call, std::chrono::steady_clock::time_point deadline) {
        auto& me = segment_.me();
        const std::uint64_t target = me.stage.load(std::memory_order_relaxed) + 1;
        me.stage.store(target, std::memory_order_release);
        for (int s = 0; s < segment_.size(); ++s)
            if (s != segment_.rank()) wait_for(s, target, call, deadline);
    }

    // Waits for rank s to reach meeting `target`. Another process cannot ring a Doorbell, so the
    // wait naps after its spin and yields; the peer checks (a system call) run every 2 ms.
    void wait_for(int s, std::uint64_t target, const CollectiveCall& call,
                  std::chrono::steady_clock::time_point deadline) {
        auto& peer = segment_.rank_state(s);
        auto arrived = [&] { return peer.stage.load(std::memory_order_acquire) >= target; };
        auto checked = std::chrono::steady_clock::now();
        wait_until(
            arrived,
            [&] {
                throw_if_aborted(call);
                const auto now = std::chrono::steady_clock::now();
                if (now - checked < std::chrono::milliseconds(2)) return;
                checked = now;
                if (arrived()) return;  // it may have arrived and then left
                check_peer(s, call);
                if (now >= deadline)
                    throw TimeoutError(segment_.who() + ": " + call.describe() + ": rank " + std::to_string(s) +
                                       " did not arrive within the timeout of " + std::to_string(timeout_.count()) +
                                       " ms. Raise the timeout if the work is just slow");
            },
            Nap(std::chrono::microseconds(50)), spin_);
    }

    // A peer whose handle is gone, or whose process has exited, will never arrive. (A process in
    // another pid namespace, a container sharing /dev/shm, is seen only by its deadline.)
    void check_peer(int s, const CollectiveCall& call) const {
        const auto& peer = segment_.rank_state(s);
        if (peer.departed.load(std::memory_order_acquire) != 0)
            throw CollectiveError(segment_.who() + ": " + call.describe() + ": rank " + std::to_string(s) +
                                  " left the group (its SharedMemoryBackend was destroyed) before this collective");
        const auto pid = peer.pid.load(std::memory_order_relaxed);
        const auto ns = peer.pid_namespace.load(std::memory_order_relaxed);
        const bool same_namespace = ns != 0 && ns == segment_.me().pid_namespace.load(std::memory_order_relaxed);
        if (same_namespace && pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH)
            throw CollectiveError(segment_.who() + ": " + call.describe() + ": rank " + std::to_string(s) +
                                  " (process " + std::to_string(pid) + ") has exited");
    }

    // After the first meeting: every rank checks every rank's call against rank 0's, so that all
    // of them find the same first difference and throw the same message.
    void validate(const CollectiveCall& call) const {
        const CollectiveCall ref = segment_.rank_state(0).calls[call.seq & 1].call();
        for (int s = 1; s < segment_.size(); ++s) {
            const CollectiveCall other = segment_.rank_state(s).calls[call.seq & 1].call();
            if (!other.same_as(ref)) throw CollectiveError(segment_.who() + ": " + mismatch_message(ref, s, other));
        }
    }

    SharedSegment segment_;
    std::chrono::milliseconds timeout_;
    AlignedBytes block_;         // reduce_to_all's scratch
    std::vector<void*> inputs_;  // every rank's piece of the current chunk
    std::uint64_t chunk_ = 0;    // chunks run so far: the parity of the next one's slots
    SpinBudget spin_;
};

}  // namespace gradsync::inline v0::detail
