// The vocabulary of collectives: memory to reduce (a Buffer, or Segments of one dtype), the
// reduction operator, and the tag that says what a collective is for.
#pragma once

#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::min
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0 {

enum class ReduceOp : std::uint8_t {
    sum,
    average,  // sum divided by the number of ranks
};

inline std::string to_string(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "average"; }

// `count` elements at `data`; the dtype travels beside it.
struct Segment {
    void* data = nullptr;
    std::size_t count = 0;
};

// A contiguous buffer of `count` elements of `dtype`.
struct Buffer {
    void* data = nullptr;
    std::size_t count = 0;
    DType dtype = DType::float32;
};

template <HasDType T>
Buffer buffer_of(std::span<T> s) {
    return Buffer{s.data(), s.size(), dtype_of<T>};
}

// One rank's part of a reduce_scatter or all_gather of `count` elements over `ranks` ranks: the
// contiguous elements [offset, offset + count). Shards differ by at most one element; the first
// (count % ranks) ranks own the longer ones, so a count below the number of ranks leaves the last
// ranks empty shards. Every backend splits by this rule.
struct Shard {
    std::size_t offset = 0;
    std::size_t count = 0;

    friend bool operator==(const Shard&, const Shard&) = default;
};

inline Shard shard_of(std::size_t count, int ranks, int rank) {
    if (ranks < 1 || rank < 0 || rank >= ranks)
        throw Error("gradsync: shard_of needs 0 <= rank < ranks, got rank " + std::to_string(rank) + " of " +
                    std::to_string(ranks));
    const auto n = static_cast<std::size_t>(ranks), r = static_cast<std::size_t>(rank);
    const std::size_t base = count / n, longer = count % n;
    return Shard{r * base + std::min(r, longer), base + (r < longer ? 1 : 0)};
}

// What a collective is for, so that a mismatch across ranks is named in terms the user knows.
// `fingerprint` folds every collective the caller issued so far: equal fingerprints mean equal
// histories, so a divergence is caught even where the current calls happen to look alike.
struct CollectiveTag {
    std::uint64_t fingerprint = 0;
    std::int64_t step = -1;    // -1: not a training step's collective
    std::int32_t bucket = -1;  // -1: not a bucket's collective

    friend bool operator==(const CollectiveTag&, const CollectiveTag&) = default;
};

namespace detail {

inline std::size_t total_count(std::span<const Segment> segs) {
    std::size_t n = 0;
    for (const auto& s : segs) n += s.count;
    return n;
}

// For each of `segments` (one after another) that crosses elements [lo, hi) of the whole:
// fn(k, from, begin, n), its part from its own element `from` on, n long, which begins at element
// `begin` of the whole.
template <class Fn>
void for_each_within(std::span<const Segment> segments, std::size_t lo, std::size_t hi, Fn&& fn) {
    std::size_t at = 0;
    for (std::size_t k = 0; k < segments.size(); ++k) {
        const std::size_t n = segments[k].count, begin = std::max(lo, at), end = std::min(hi, at + n);
        if (begin < end) fn(k, begin - at, begin, end - begin);
        at += n;
    }
}

// The parts of `segments` (of dtype `t`, one after another) that lie within elements [lo, hi).
inline std::vector<Segment> segments_within(std::span<const Segment> segments, std::size_t lo, std::size_t hi,
                                            DType t) {
    std::vector<Segment> out;
    const std::size_t elem = size_of(t);
    for_each_within(segments, lo, hi, [&](std::size_t k, std::size_t from, std::size_t, std::size_t n) {
        out.push_back({static_cast<std::byte*>(segments[k].data) + from * elem, n});
    });
    return out;
}

}  // namespace detail

}  // namespace gradsync::inline v0
