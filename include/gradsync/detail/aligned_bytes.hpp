// AlignedBytes: an owning, cache-line aligned byte buffer whose pages are touched at allocation,
// so the first training step does not pay for page faults.
#pragma once

#include <gradsync/version.hpp>

#include <cstddef>
#include <cstdlib>  // for std::aligned_alloc, std::free
#include <cstring>  // for std::memset
#include <memory>   // for std::unique_ptr
#include <new>      // for std::bad_alloc

namespace gradsync::inline v0::detail {

inline constexpr std::size_t cache_line = 64;

class AlignedBytes {
public:
    AlignedBytes() = default;
    explicit AlignedBytes(std::size_t size) : size_(size) {
        if (size == 0) return;
        std::size_t rounded = (size + cache_line - 1) / cache_line * cache_line;
        void* p = std::aligned_alloc(cache_line, rounded);
        if (p == nullptr) throw std::bad_alloc();
        std::memset(p, 0, rounded);  // touch every page now
        data_.reset(static_cast<std::byte*>(p));
    }

    [[nodiscard]] std::byte* data() const { return data_.get(); }
    [[nodiscard]] std::size_t size() const { return size_; }

private:
    struct Free {
        void operator()(std::byte* p) const { std::free(p); }
    };
    std::unique_ptr<std::byte, Free> data_;
    std::size_t size_ = 0;
};

}  // namespace gradsync::inline v0::detail
