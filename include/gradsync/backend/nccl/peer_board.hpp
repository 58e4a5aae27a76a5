// Where the ranks of one NCCL communicator that share this process stand (nccl_spawn: one thread
// per GPU), for the message of a collective that missed its deadline: how many collectives each
// has entered and what the trainer's front says about it (its status reporters: in the backward
// of step 7, waiting for the gradients of ...). NCCL's host side cannot see ranks in other
// processes; those are only listed. Plain C++.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>  // for std::function
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0::detail {

class NcclPeerBoard {
public:
    // The board of the communicator known in this process by `key` (its unique id, or its
    // parent's key and colour for a split), shared by its ranks here; made by the first.
    static std::shared_ptr<NcclPeerBoard> of(const std::string& key, int size) {
        static std::mutex mutex;
        static std::map<std::string, std::weak_ptr<NcclPeerBoard>> boards;
        std::lock_guard lock(mutex);
        std::erase_if(boards, [](const auto& entry) { return entry.second.expired(); });
        auto& slot = boards[key];
        auto board = slot.lock();
        if (!board || board->slots_.size() != static_cast<std::size_t>(size)) {
            board = std::make_shared<NcclPeerBoard>(size);
            slot = board;
        }
        return board;
    }

    explicit NcclPeerBoard(int size) : slots_(static_cast<std::size_t>(size)) {}

    // Rank `rank` is here, numbering its collectives in `calls`, until it leaves.
    void join(int rank, const std::atomic<std::uint64_t>* calls) {
        std::lock_guard lock(mutex_);
        slots_.at(idx(rank)).calls = calls;
    }
    void leave(int rank) {
        std::lock_guard lock(mutex_);
        auto& slot = slots_.at(idx(rank));
        slot.calls = nullptr;
        slot.left = true;
        slot.reporters.clear();
    }

    // A reporter of rank `rank`, quoted in its peers' messages until removed (which waits for a
    // quote in progress).
    std::uint64_t add_reporter(int rank, std::function<std::string()> reporter) {
        std::lock_guard lock(mutex_);
        slots_.at(idx(rank)).reporters.emplace_back(++next_reporter_, std::move(reporter));
        return next_reporter_;
    }
    void remove_reporter(int rank, std::uint64_t id) {
        std::lock_guard lock(mutex_);
        std::erase_if(slots_.at(idx(rank)).reporters, [id](const auto& r) { return r.first == id; });
    }

    // " Where its peers in this process stand: rank 1 has entered 3 collectives (this rank 4): in
    // the backward of step 2, ...; not seen from here (...): ranks 2, 3", or empty where no peer
    // of rank `me` shares this process.
    [[nodiscard]] std::string standings(int me) {
        std::lock_guard lock(mutex_);
        const auto* mine = slots_.at(idx(me)).calls;
        const std::uint64_t entered = mine != nullptr ? mine->load(std::memory_order_relaxed) : 0;
        std::string here, elsewhere;
        for (std::size_t r = 0; r < slots_.size(); ++r) {
            if (r == idx(me)) continue;
            const auto& slot = slots_[r];
            const std::string rank = "rank " + std::to_string(r);
            if (slot.left) {
                here += (here.empty() ? "" : "; ") + rank + " has left the communicator";
            } else if (slot.calls == nullptr) {
                elsewhere += (elsewhere.empty() ? "" : ", ") + std::to_string(r);
            } else {
                std::string said;
                for (const auto& reporter : slot.reporters) said += (said.empty() ? "" : "; ") + reporter.second();
                here += (here.empty() ? "" : "; ") + rank + " has entered " +
                        std::to_string(slot.calls->load(std::memory_order_relaxed)) + " collectives (this rank " +
                        std::to_string(entered) + ")" + (said.empty() ? "" : ": " + said);
            }
        }
        if (here.empty()) return {};
        return " Where its peers in this process stand: " + here +
               (elsewhere.empty() ? ""
                                  : "; not seen from here (in other processes, or not joined): ranks " + elsewhere);
    }

private:
    struct Slot {
        const std::atomic<std::uint64_t>* calls = nullptr;  // while the rank is here
        bool left = false;
        std::vector<std::pair<std::uint64_t, std::function<std::string()>>> reporters;
    };
    static std::size_t idx(int rank) { return static_cast<std::size_t>(rank); }

    std::mutex mutex_;
    std::vector<Slot> slots_;
    std::uint64_t next_reporter_ = 0;
};

}  // namespace gradsync::inline v0::detail
