// A cursor over a list of segments (the pieces of memory one collective reduces), element by
// element: how a rank finds the same element in every peer's differently cut buffers.
#pragma once

#include <gradsync/version.hpp>

#include <gradsync/buffer.hpp>

#include <cstddef>
#include <span>

namespace gradsync::inline v0::detail {

// Walks a list of segments element by element.
class SegmentCursor {
public:
    SegmentCursor(std::span<const Segment> segs, std::size_t start, std::size_t elem_size)
        : it_(segs.data()), end_(segs.data() + segs.size()), elem_(elem_size) {
        while (it_ != end_ && start >= it_->count) {
            start -= it_->count;
            ++it_;
        }
        offset_ = start;
        skip_empty();
    }
    [[nodiscard]] std::size_t left() const { return it_ == end_ ? 0 : it_->count - offset_; }
    [[nodiscard]] std::byte* ptr() const { return static_cast<std::byte*>(it_->data) + offset_ * elem_; }
    void advance(std::size_t k) {
        offset_ += k;
        skip_empty();
    }

private:
    void skip_empty() {
        while (it_ != end_ && offset_ >= it_->count) {
            offset_ -= it_->count;
            ++it_;
        }
    }
    const Segment* it_;
    const Segment* end_;
    std::size_t offset_ = 0;
    std::size_t elem_;
};

}  // namespace gradsync::inline v0::detail
