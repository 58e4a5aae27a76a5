// HeldSegments: an asynchronous collective's copy of the segment list it was given, kept until it
// runs. One segment (a bucket's buffer, the common case) is kept inline, so launching it
// allocates nothing for the list.
#pragma once

#include <gradsync/buffer.hpp>

#include <span>
#include <vector>

namespace gradsync::inline v0::detail {

class HeldSegments {
public:
    explicit HeldSegments(std::span<const Segment> segments) {
        if (segments.size() == 1)
            single_ = segments[0];
        else
            many_.assign(segments.begin(), segments.end());
        one_ = segments.size() == 1;
    }
    explicit HeldSegments(Segment one) : single_(one), one_(true) {}

    // Valid while this object lives and is not moved.
    [[nodiscard]] std::span<const Segment> get() const {
        if (one_) return {&single_, 1};
        return many_;
    }

private:
    Segment single_{};
    std::vector<Segment> many_;
    bool one_ = false;
};

}  // namespace gradsync::inline v0::detail
