// The collectives of a LocalBackend group, run by the ranks' threads in shared memory: allreduce
// (one-shot through staging for small buffers, two-phase in place for large ones),
// reduce_scatter, all_gather, broadcast and barrier. Every one starts with a round in which the
// ranks publish and check their calls, and ends with one after which no peer reads its memory;
// one that leaves early (the group aborted) first waits for the peers still reading it.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/detail/host_reduce.hpp>
#include <gradsync/backend/detail/local_group.hpp>
#include <gradsync/backend/detail/segment_cursor.hpp>
#include <gradsync/backend/local_options.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/dtype.hpp>

#include <algorithm>  // for std::min, std::max
#include <chrono>
#include <cstddef>
#include <cstring>  // for std::memcpy
#include <optional>
#include <string>
#include <thread>  // for std::this_thread::yield

namespace gradsync::inline v0::detail {

// The unit of work ranks claim in a two-phase allreduce: a rank's whole share up to 256 KiB, so
// that each rank reduces the same elements every call, in its own cache (a share cut in four took
// 5 to 15 % longer from 16 to 64 KiB on 2 ranks); above it, 256 KiB pieces, so that a rank whose
// thread stalls leaves its peers little to wait on. At least 2 KiB: claiming is no cheaper than
// reducing that much, and 4 KiB on 2 ranks is then one piece each (0.7 us against 0.85 as one).
inline std::size_t piece_elements(std::size_t n, std::size_t ranks, std::size_t element_bytes) {
    const std::size_t least = 2048 / element_bytes, most = (std::size_t{256} << 10) / element_bytes;
    return std::clamp((n + ranks - 1) / ranks, least, most);
}
template <class T>
std::size_t piece_elements(std::size_t n, std::size_t ranks) {
    return piece_elements(n, ranks, sizeof(T));
}

class LocalGroup : public LocalGroupState {
public:
    using LocalGroupState::LocalGroupState;

    // Runs one collective for `rank` on the calling thread.
    void execute(int rank, const LocalCall& call) {
        auto deadline = detail::deadline_after(options_.timeout);
        throw_if_aborted(rank, call);
        ranks_[idx(rank)].calls_entered.store(call.seq, std::memory_order_relaxed);
        if (size_ == 1) return execute_alone(rank, call);
        try {
            run(rank, call, deadline);
        } catch (...) {
            // Leaving early (the group was aborted): this rank's memory may go as this returns,
            // so first every peer still reading it must be done.
            ranks_[idx(rank)].reading.store(false, std::memory_order_seq_cst);
            wait_for_readers(rank);
            throw;
        }
    }

private:
    void run(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        switch (call.kind) {
            case CollectiveKind::allreduce:
                if (!reducible(*call.dtype))
                    fail(rank, call, "LocalBackend reduces floating-point types only, not " + to_string(*call.dtype));
                return visit_float_dtype(*call.dtype,
                                         [&]<class T>(type_tag<T>) { allreduce<T>(rank, call, deadline); });
            case CollectiveKind::reduce_scatter:
                if (!reducible(*call.dtype))
                    fail(rank, call, "LocalBackend reduces floating-point types only, not " + to_string(*call.dtype));
                return visit_float_dtype(*call.dtype,
                                         [&]<class T>(type_tag<T>) { reduce_scatter<T>(rank, call, deadline); });
            case CollectiveKind::all_gather: return all_gather(rank, call, deadline);
            case CollectiveKind::broadcast: return broadcast(rank, call, deadline);
            case CollectiveKind::barrier: return barrier(rank, call, deadline);
        }
    }

    // After the first round, before reading any peer's memory: a rank leaving on an abort waits
    // for those reading (wait_for_readers); this reads the abort after saying it reads, and the
    // leaving rank reads this after the abort, so one of them always sees the other.
    void start_reading(int rank, const LocalCall& call) {
        auto& me = ranks_[idx(rank)];
        me.reading.store(true, std::memory_order_seq_cst);
        if (aborted_.load(std::memory_order_seq_cst)) {
            me.reading.store(false, std::memory_order_seq_cst);
            throw_if_aborted(rank, call);
        }
    }
    // Done reading peers' memory: the closing round, after which nobody reads this rank's.
    void end(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        ranks_[idx(rank)].reading.store(false, std::memory_order_seq_cst);
        round(rank, call, deadline);
    }
    // Until no peer reads (pure memory work, done within moments; bounded all the same).
    void wait_for_readers(int rank) {
        const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        for (int s = 0; s < size_; ++s) {
            if (s == rank) continue;
            while (ranks_[idx(s)].reading.load(std::memory_order_seq_cst) && std::chrono::steady_clock::now() < limit)
                std::this_thread::yield();
        }
    }

    void execute_alone(int rank, const LocalCall& call) {
        const bool reduces = call.kind == CollectiveKind::allreduce || call.kind == CollectiveKind::reduce_scatter;
        if (reduces && !reducible(*call.dtype))
            fail(rank, call, "LocalBackend reduces floating-point types only, not " + to_string(*call.dtype));
        if (call.kind == CollectiveKind::broadcast && call.root != 0)
            fail(rank, call, "root " + std::to_string(call.root) + " is not a rank of this group of 1");
        // One rank: sum and average are the identity, its shard is the whole buffer, broadcast and
        // barrier are no-ops.
    }

    template <class T>
    void allreduce(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        bool one_shot =
            options_.algorithm == LocalAlgorithm::one_shot || (options_.algorithm == LocalAlgorithm::automatic &&
                                                               call.count * sizeof(T) <= options_.one_shot_max.count());
        if (one_shot)
            allreduce_one_shot<T>(rank, call, deadline);
        else
            allreduce_two_phase<T>(rank, call, deadline);
    }

    template <class T>
    void allreduce_one_shot(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        auto& me = ranks_[idx(rank)];
        const std::size_t piece = staging_bytes_ / sizeof(T);
        const auto factor = accumulator_t<T>(1) / static_cast<accumulator_t<T>>(size_);
        SegmentCursor in(call.segs(), 0, sizeof(T));
        SegmentCursor out(call.segs(), 0, sizeof(T));
        std::size_t pos = 0;
        bool first = true;
        do {
            std::size_t len = std::min(piece, call.count - pos);
            unsigned parity = static_cast<unsigned>(me.epoch.load(std::memory_order_relaxed) & 1u);
            // Gather this piece of my input into my staging slot.
            auto* slot = me.staging[parity].data();
            for (std::size_t done = 0; done < len;) {
                std::size_t k = std::min(len - done, in.left());
                std::memcpy(slot + done * sizeof(T), in.ptr(), k * sizeof(T));
                in.advance(k);
                done += k;
            }
            if (first) me.calls[parity] = call;
            round(rank, call, deadline);
            if (first) validate(rank, call, parity);
            first = false;
            // Sum every rank's slot, in rank order, into my own buffer.
            auto** inputs = reinterpret_cast<T**>(me.pointers.data());
            for (int s = 0; s < size_; ++s) inputs[s] = reinterpret_cast<T*>(ranks_[idx(s)].staging[parity].data());
            for (std::size_t done = 0; done < len;) {
                std::size_t k = std::min(len - done, out.left());
                T* dst = reinterpret_cast<T*>(out.ptr());
                reduce_to_all<T>(inputs, size_, &dst, 1, k, call.op == ReduceOp::average, factor, me.block.data());
                for (int s = 0; s < size_; ++s) inputs[s] += k;
                out.advance(k);
                done += k;
            }
            pos += len;
        } while (pos < call.count);
    }

    template <class T>
    void allreduce_two_phase(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        auto& me = ranks_[idx(rank)];
        // My share: a contiguous 1/n of the pieces, taken from the front; then what is left of
        // my peers' shares, taken from the back. A rank whose thread lost its core (to the
        // trainer's backward, another process) is not waited for: its peers finish its share.
        const std::size_t n = call.count, piece_size = piece_elements<T>(n, idx(size_));
        const std::size_t pieces = (n + piece_size - 1) / piece_size;
        const auto share_begin = [&](int r) { return pieces * static_cast<std::size_t>(r) / idx(size_); };
        me.share.reset(share_begin(rank), share_begin(rank + 1));
        const unsigned parity = begin(rank, call, deadline);
        start_reading(rank, call);
        for (int k = 0; k < size_; ++k) {
            auto& share = ranks_[idx((rank + k) % size_)].share;
            const auto end = k == 0 ? PieceClaims::End::front : PieceClaims::End::back;
            while (const auto piece = share.take(end)) {
                const std::size_t lo = *piece * piece_size;
                reduce_range<T>(rank, call, parity, lo, std::min(n, lo + piece_size));
            }
        }
        // Nobody returns, and reuses its buffer, before every piece is written.
        end(rank, call, deadline);
    }

    // Sums elements [lo, hi) of every rank's buffer, in rank order, into all of them, or into rank
    // `only`'s alone.
    template <class T>
    void reduce_range(int rank, const LocalCall& call, unsigned parity, std::size_t lo, std::size_t hi,
                      std::optional<int> only = std::nullopt) {
        auto& me = ranks_[idx(rank)];
        const auto factor = accumulator_t<T>(1) / static_cast<accumulator_t<T>>(size_);
        me.cursors.clear();
        for (int s = 0; s < size_; ++s) me.cursors.emplace_back(ranks_[idx(s)].calls[parity].segs(), lo, sizeof(T));
        auto** ptrs = reinterpret_cast<T**>(me.pointers.data());
        for (std::size_t pos = lo; pos < hi;) {
            std::size_t k = hi - pos;
            for (const auto& c : me.cursors) k = std::min(k, c.left());
            for (int s = 0; s < size_; ++s) ptrs[s] = reinterpret_cast<T*>(me.cursors[idx(s)].ptr());
            T* single = only ? ptrs[*only] : nullptr;
            reduce_to_all<T>(ptrs, size_, only ? &single : ptrs, only ? 1 : size_, k, call.op == ReduceOp::average,
                             factor, me.block.data());
            for (auto& c : me.cursors) c.advance(k);
            pos += k;
        }
    }

    void broadcast(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        check_root(rank, call);
        const unsigned parity = begin(rank, call, deadline);
        start_reading(rank, call);
        if (rank != call.root && call.count != 0) {
            std::memcpy(call.single.data, ranks_[idx(call.root)].calls[parity].single.data, call.count);
        }
        end(rank, call, deadline);
    }

    void barrier(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        begin(rank, call, deadline);
    }

    // Rank r sums shard r from every rank's buffer, in rank order (the allreduce's bits), into
    // its own: each byte read once and each shard written once, as the two-phase allreduce's
    // first half. Shard r comes in pieces that rank r takes from the front and a peer done with
    // its own shard from the back, so a rank whose thread lost its core is not waited for.
    // Nobody writes what another reads: a piece is read and written by the thread that took it.
    template <class T>
    void reduce_scatter(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        const std::size_t piece = piece_elements<T>(call.count, idx(size_));
        const Shard mine = shard_of(call.count, size_, rank);
        ranks_[idx(rank)].share.reset(0, (mine.count + piece - 1) / piece);
        const unsigned parity = begin(rank, call, deadline);
        start_reading(rank, call);
        for (int k = 0; k < size_; ++k) {
            const int owner = (rank + k) % size_;
            const Shard shard = shard_of(call.count, size_, owner);
            while (const auto p =
                       ranks_[idx(owner)].share.take(k == 0 ? PieceClaims::End::front : PieceClaims::End::back)) {
                const std::size_t lo = shard.offset + *p * piece;
                reduce_range<T>(rank, call, parity, lo, std::min(shard.offset + shard.count, lo + piece), owner);
            }
        }
        // Nobody returns, and reuses its buffer, before every shard is read.
        end(rank, call, deadline);
    }

    // Every rank's buffer gets every other rank's shard, copied from that rank's buffer. What rank
    // r receives comes in pieces (each within one sender's shard) that r takes from the front and
    // a peer done with its own from the back. Nobody writes what another reads: rank s's shard s
    // is only read; rank r's other shards are only written, each piece by the thread that took it.
    void all_gather(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        const std::size_t elem = size_of(*call.dtype);
        const std::size_t piece = piece_elements(call.count, idx(size_), elem);
        ranks_[idx(rank)].share.reset(0, gather_pieces(call.count, rank, piece, size_));
        const unsigned parity = begin(rank, call, deadline);
        start_reading(rank, call);
        const bool streaming = call.count * elem * idx(size_) >= streaming_min_bytes;
        for (int k = 0; k < size_; ++k) {
            const int to = (rank + k) % size_;
            while (const auto p = ranks_[idx(to)].share.take(k == 0 ? PieceClaims::End::front : PieceClaims::End::back))
                gather_piece(call.count, parity, to, *p, piece, elem, streaming);
        }
        if (streaming) streaming_fence();
        end(rank, call, deadline);
    }
    // The pieces rank `to` receives in an all_gather: every other rank's shard, in rank order.
    static std::size_t gather_pieces(std::size_t count, int to, std::size_t piece, int size) {
        std::size_t pieces = 0;
        for (int s = 0; s < size; ++s)
            if (s != to) pieces += (shard_of(count, size, s).count + piece - 1) / piece;
        return pieces;
    }
    // Copies piece `p` of what rank `to` receives from its sender's buffer into rank to's.
    void gather_piece(std::size_t count, unsigned parity, int to, std::size_t p, std::size_t piece, std::size_t elem,
                      bool streaming) {
        int from = 0;
        Shard shard{};
        for (;; ++from) {  // the sender whose shard holds piece p
            if (from == to) continue;
            shard = shard_of(count, size_, from);
            const std::size_t pieces = (shard.count + piece - 1) / piece;
            if (p < pieces) break;
            p -= pieces;
        }
        const std::size_t lo = shard.offset + p * piece, n = std::min(piece, shard.offset + shard.count - lo);
        SegmentCursor source(ranks_[idx(from)].calls[parity].segs(), lo, elem);
        SegmentCursor target(ranks_[idx(to)].calls[parity].segs(), lo, elem);
        for (std::size_t done = 0; done < n;) {
            const std::size_t k = std::min({n - done, source.left(), target.left()});
            if (streaming)
                copy_streaming(target.ptr(), source.ptr(), k * elem);
            else
                std::memcpy(target.ptr(), source.ptr(), k * elem);
            source.advance(k);
            target.advance(k);
            done += k;
        }
    }

    // Publishes this rank's call, meets the others and checks that they are in the same one.
    // Returns the round's parity (where the calls are).
    unsigned begin(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        auto& me = ranks_[idx(rank)];
        const auto parity = static_cast<unsigned>(me.epoch.load(std::memory_order_relaxed) & 1u);
        me.calls[parity] = call;
        round(rank, call, deadline);
        validate(rank, call, parity);
        return parity;
    }
};

}  // namespace gradsync::inline v0::detail
