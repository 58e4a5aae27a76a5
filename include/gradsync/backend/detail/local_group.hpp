// The shared state of a LocalBackend group: each rank's slot (its current call, staging, the
// barrier rounds it has arrived at), the rounds in which ranks meet, and the checks that every
// rank called the same collective and that nobody waits past the deadline. The collectives
// themselves are in local_collectives.hpp.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/detail/piece_claims.hpp>
#include <gradsync/backend/detail/segment_cursor.hpp>
#include <gradsync/backend/group_label.hpp>
#include <gradsync/detail/host_reduce.hpp>
#include <gradsync/backend/local_options.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/detail/aligned_bytes.hpp>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/detail/wait.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

#include <algorithm>  // for std::min, std::max
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>     // for std::memcpy
#include <functional>  // for std::function
#include <mutex>
#include <span>
#include <string>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0 {

namespace detail {

// One rank's collective (what every rank's must equal), with its buffers, published so that its
// peers can check they are in the same call and find the memory it reduces.
struct LocalCall : CollectiveCall {
    const Segment* segments = nullptr;  // null: the one segment is `single`
    std::size_t segment_count = 0;
    Segment single{};

    [[nodiscard]] std::span<const Segment> segs() const {
        return segments != nullptr ? std::span<const Segment>(segments, segment_count)
                                   : std::span<const Segment>(&single, 1);
    }
};

// One rank's slot in the group: written by that rank, read by its peers.
struct alignas(cache_line) LocalRankState {
    std::atomic<std::uint64_t> epoch{0};  // barrier rounds this rank has arrived at
    alignas(cache_line) std::atomic<bool> departed{false};
    // Between a collective's first round and its closing one, where it reads its peers' memory.
    std::atomic<bool> reading{false};
    std::atomic<std::uint64_t> calls_entered{0};
    PieceClaims share;        // of a two-phase allreduce, a reduce_scatter or an all_gather
    LocalCall calls[2];       // the current collective, by round parity
    AlignedBytes staging[2];  // one-shot input copies, by round parity
    // Scratch for the thread executing this rank's collectives.
    AlignedBytes block;  // reduce_block_bytes
    std::vector<SegmentCursor> cursors;
    std::vector<void*> pointers;
    SpinBudget spin;  // how long its waits for peers spin
};

class LocalGroupState {
public:
    LocalGroupState(int size, LocalGroupOptions options, GroupLabel label = {})
        : size_(size),
          options_(options),
          label_(std::move(label)),
          ranks_(static_cast<std::size_t>(size)),
          reporters_(static_cast<std::size_t>(size)) {
        std::size_t slot = std::max<std::size_t>(4096, options.one_shot_max.count());
        slot = (slot + cache_line - 1) / cache_line * cache_line;
        staging_bytes_ = slot;
        for (auto& r : ranks_) {
            r.staging[0] = AlignedBytes(slot);
            r.staging[1] = AlignedBytes(slot);
            r.block = AlignedBytes(reduce_block_bytes);
            r.pointers.resize(static_cast<std::size_t>(size));
            r.cursors.reserve(static_cast<std::size_t>(size));
        }
    }

    [[nodiscard]] int size() const { return size_; }
    [[nodiscard]] const LocalGroupOptions& options() const { return options_; }
    [[nodiscard]] const GroupLabel& label() const { return label_; }
    [[nodiscard]] Bytes memory_per_rank() const { return Bytes{2 * staging_bytes_ + reduce_block_bytes}; }

    // Fails every pending and future collective of every rank with `reason`. First reason wins.
    void abort(const std::string& reason) {
        {
            std::lock_guard lock(abort_mutex_);
            if (aborted_.load(std::memory_order_relaxed)) return;
            abort_reason_ = reason;
            aborted_.store(true, std::memory_order_seq_cst);
        }
        bell_.ring();
    }
    [[nodiscard]] bool aborted() const { return aborted_.load(std::memory_order_acquire); }
    // Throws, once the group was aborted, why: for a rank whose collectives all completed before a
    // peer failed its step.
    void throw_if_aborted(int rank) const {
        if (aborted()) throw CollectiveError(label_.who(rank) + ": the group was aborted: " + abort_reason());
    }

    // The rank's handle is gone: peers waiting for it fail instead of waiting for the deadline.
    void depart(int rank) {
        ranks_[idx(rank)].departed.store(true, std::memory_order_seq_cst);
        bell_.ring();
    }

    std::uint64_t add_status_reporter(int rank, std::function<std::string()> reporter) {
        std::lock_guard lock(status_mutex_);
        reporters_[idx(rank)].push_back({++next_reporter_, std::move(reporter)});
        return next_reporter_;
    }
    void remove_status_reporter(int rank, std::uint64_t id) {
        std::lock_guard lock(status_mutex_);
        auto& list = reporters_[idx(rank)];
        std::erase_if(list, [id](const Reporter& r) { return r.id == id; });
    }

    // What rank `rank` says about itself, for a peer's diagnosis: its reporters' words.
    [[nodiscard]] std::string status_of(int rank) {
        if (ranks_[idx(rank)].departed.load(std::memory_order_acquire)) return "it has left the group";
        std::lock_guard lock(status_mutex_);
        std::string out;
        for (const auto& reporter : reporters_[idx(rank)]) out += (out.empty() ? "" : "; ") + reporter.report();
        return out;
    }
    [[nodiscard]] std::uint64_t collectives_entered(int rank) const {
        return ranks_[idx(rank)].calls_entered.load(std::memory_order_relaxed);
    }

protected:
    static std::size_t idx(int rank) { return static_cast<std::size_t>(rank); }

    [[noreturn]] void fail(int rank, const LocalCall& call, const std::string& reason) {
        std::string msg = label_.who(rank) + ", " + call.describe() + ": " + reason;
        abort(msg);
        throw CollectiveError(msg);
    }

    void throw_if_aborted(int rank, const LocalCall& call) {
        if (!aborted()) return;
        throw CollectiveError(label_.who(rank) + ", " + call.describe() + ": the group was aborted: " + abort_reason());
    }
    [[nodiscard]] std::string abort_reason() const {
        std::lock_guard lock(abort_mutex_);
        return abort_reason_;
    }

    // Arrive at the next round and wait until every rank has. Returns the round's parity.
    unsigned round(int rank, const LocalCall& call, std::chrono::steady_clock::time_point deadline) {
        auto& me = ranks_[idx(rank)];
        std::uint64_t target = me.epoch.load(std::memory_order_relaxed) + 1;
        me.epoch.store(target, std::memory_order_seq_cst);
        bell_.ring();
        for (int s = 0; s < size_; ++s) {
            if (s == rank) continue;
            auto& peer = ranks_[idx(s)];
            auto ready = [&] { return peer.epoch.load(std::memory_order_acquire) >= target; };
            if (ready()) continue;
            wait_until(
                ready, [&] { check_wait(rank, s, target, call, deadline); }, bell_, me.spin);
        }
        return static_cast<unsigned>((target - 1) & 1u);
    }

    void check_wait(int rank, int peer_rank, std::uint64_t target, const LocalCall& call,
                    std::chrono::steady_clock::time_point deadline) {
        throw_if_aborted(rank, call);
        auto& peer = ranks_[idx(peer_rank)];
        if (peer.departed.load(std::memory_order_seq_cst) && peer.epoch.load(std::memory_order_seq_cst) < target) {
            fail(rank, call,
                 "rank " + std::to_string(peer_rank) +
                     " left the group (its LocalBackend was destroyed, or its spawn function returned) "
                     "without entering this collective; it had entered " +
                     std::to_string(peer.calls_entered.load(std::memory_order_relaxed)) + " collectives");
        }
        if (std::chrono::steady_clock::now() >= deadline) {
            std::string msg = label_.who(rank) + ", " + call.describe() + ": timed out after " +
                              std::to_string(options_.timeout.count()) + " ms waiting for rank " +
                              std::to_string(peer_rank) + ", which has entered " +
                              std::to_string(collectives_entered(peer_rank)) + " collectives" +
                              [&] {
                                  auto status = status_of(peer_rank);
                                  return status.empty() ? std::string() : " (" + status + ")";
                              }() +
                              ". Raise the timeout if the work is just slow";
            abort(msg);
            throw TimeoutError(msg);
        }
    }

    // After the first round: every rank checks every rank's call against rank 0's, so that all
    // of them find the same first difference and throw the same message.
    void validate(int rank, const LocalCall& call, unsigned parity) {
        const LocalCall& ref = ranks_[0].calls[parity];
        for (int s = 1; s < size_; ++s) {
            const LocalCall& other = ranks_[idx(s)].calls[parity];
            if (!other.same_as(ref)) fail(rank, call, mismatch_message(ref, s, other));
        }
    }

    void check_root(int rank, const LocalCall& call) {
        if (call.root < 0 || call.root >= size_)
            fail(rank, call,
                 "root " + std::to_string(call.root) + " is not a rank of this group of " + std::to_string(size_));
    }

    int size_;
    LocalGroupOptions options_;
    GroupLabel label_;
    std::size_t staging_bytes_ = 0;
    std::vector<LocalRankState> ranks_;
    Doorbell bell_;
    std::atomic<bool> aborted_{false};
    mutable std::mutex abort_mutex_;
    std::string abort_reason_;
    struct Reporter {
        std::uint64_t id;
        std::function<std::string()> report;
    };
    std::mutex status_mutex_;
    std::uint64_t next_reporter_ = 0;
    std::vector<std::vector<Reporter>> reporters_;  // per rank
};

}  // namespace detail

}  // namespace gradsync::inline v0
