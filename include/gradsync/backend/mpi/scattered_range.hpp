// Element ranges of segments laid end to end, for the sharded ring over memory that lies where
// the model keeps it: a range that falls within one segment is sent as plain bytes; one that
// crosses segments as an MPI datatype of its pieces at their addresses, so that MPI reads or
// writes them where they lie and nothing is packed by hand.
#pragma once

#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/buffer.hpp>  // for Segment

#include <algorithm>  // for std::upper_bound, std::min
#include <cstddef>
#include <span>
#include <vector>

namespace gradsync::inline v0::detail {

class ScatteredElements {
public:
    ScatteredElements(std::span<const Segment> segments, std::size_t elem) : segments_(segments), elem_(elem) {
        starts_.reserve(segments.size() + 1);
        std::size_t at = 0;
        for (const auto& s : segments) {
            starts_.push_back(at);
            at += s.count;
        }
        starts_.push_back(at);
    }

    [[nodiscard]] std::size_t count() const { return starts_.back(); }

    // Calls f(bytes, elements) for each contiguous run of elements [begin, begin + n), in order.
    template <class F>
    void for_each_run(std::size_t begin, std::size_t n, F&& f) const {
        if (n == 0) return;
        auto k =
            static_cast<std::size_t>(std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin()) - 1;
        for (std::size_t at = begin, end = begin + n; at < end; ++k) {
            const std::size_t from = at - starts_[k], take = std::min(end, starts_[k + 1]) - at;
            if (take != 0) f(static_cast<std::byte*>(segments_[k].data) + from * elem_, take);
            at += take;
        }
    }

private:
    std::span<const Segment> segments_;
    std::size_t elem_;
    std::vector<std::size_t> starts_;  // first element of each segment, then the total
};

// What MPI_Send and MPI_Recv take for a range of ScatteredElements: its address and byte count
// when it is one run, else MPI_BOTTOM and one element of a datatype of its runs (freed here).
class MpiRange {
public:
    MpiRange(const ScatteredElements& elements, std::size_t begin, std::size_t n, std::size_t elem) {
        std::vector<int> lengths;
        std::vector<MPI_Aint> addresses;
        std::byte* first = nullptr;
        elements.for_each_run(begin, n, [&](std::byte* p, std::size_t k) {
            if (first == nullptr) first = p;
            MPI_Aint address = 0;
            MPI_Get_address(p, &address);
            addresses.push_back(address);
            lengths.push_back(static_cast<int>(k * elem));
        });
        if (lengths.size() <= 1) {
            buffer_ = first;
            count_ = lengths.empty() ? 0 : lengths.front();
            return;
        }
        MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(), addresses.data(), MPI_BYTE, &type_);
        MPI_Type_commit(&type_);
        buffer_ = MPI_BOTTOM;
        count_ = 1;
        owned_ = true;
    }
    MpiRange(const MpiRange&) = delete;
    MpiRange& operator=(const MpiRange&) = delete;
    ~MpiRange() {
        if (owned_) MPI_Type_free(&type_);
    }

    [[nodiscard]] void* buffer() const { return buffer_; }
    [[nodiscard]] int count() const { return count_; }
    [[nodiscard]] MPI_Datatype type() const { return type_; }

private:
    void* buffer_ = nullptr;
    int count_ = 0;
    MPI_Datatype type_ = MPI_BYTE;
    bool owned_ = false;
};

}  // namespace gradsync::inline v0::detail
