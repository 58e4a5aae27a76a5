// PieceClaims: the pieces of one rank's share of a collective that nobody has taken yet. Its
// owner takes them from the front, in order; a peer done with its own share takes them from the
// back. A rank whose thread lost its core (to the trainer's backward, to another process) is then
// not waited for: its peers finish its share, and it finds nothing left when it runs again.
#pragma once

#include <gradsync/detail/aligned_bytes.hpp>  // for cache_line

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace gradsync::inline v0::detail {

class PieceClaims {
public:
    enum class End : std::uint8_t { front, back };

    // Pieces [first, end) are untaken. Only while nobody takes: before the round that starts the
    // collective, which publishes it to the peers.
    void reset(std::size_t first, std::size_t end) { range_.store(pack(first, end), std::memory_order_relaxed); }

    // Takes the first or the last untaken piece; nothing once every piece is taken. The pieces'
    // data need no ordering here: the round that ends the collective publishes them.
    [[nodiscard]] std::optional<std::size_t> take(End end) {
        auto v = range_.load(std::memory_order_relaxed);
        for (;;) {
            const std::size_t first = v & 0xffffffffu, last_end = v >> 32;
            if (first >= last_end) return std::nullopt;
            const auto taken = end == End::front ? pack(first + 1, last_end) : pack(first, last_end - 1);
            if (range_.compare_exchange_weak(v, taken, std::memory_order_relaxed))
                return end == End::front ? first : last_end - 1;
        }
    }

private:
    // Both ends in one word, so that owner and peers never take the same piece.
    static std::uint64_t pack(std::size_t first, std::size_t end) {
        return static_cast<std::uint64_t>(first) | static_cast<std::uint64_t>(end) << 32;
    }

    alignas(cache_line) std::atomic<std::uint64_t> range_{0};
};

}  // namespace gradsync::inline v0::detail
