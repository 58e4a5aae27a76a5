// The hashes: 64-bit FNV-1a over 64-bit words, byte by byte, so that the same values give the
// same hash in every process and on every machine (bucket plans, layouts, collective histories);
// and content_hash, fast enough to run over every parameter of a model (replica checks).
#pragma once

#include <gradsync/version.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>  // for std::memcpy

namespace gradsync::inline v0::detail {

inline constexpr std::uint64_t fnv1a_basis = 14695981039346656037ull;

// h with the 8 bytes of v folded in, lowest first.
constexpr std::uint64_t fnv1a(std::uint64_t h, std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
        h ^= (v >> (8 * i)) & 0xffu;
        h *= 1099511628211ull;
    }
    return h;
}

// Folds values in one after another: Fnv1a h; h.add(a).add(b); h.value().
class Fnv1a {
public:
    constexpr Fnv1a& add(std::uint64_t v) {
        h_ = fnv1a(h_, v);
        return *this;
    }
    [[nodiscard]] constexpr std::uint64_t value() const { return h_; }

private:
    std::uint64_t h_ = fnv1a_basis;
};

// A hash of `bytes` bytes at `data`. Four independent lanes, so that memory bandwidth rather than
// one multiply chain sets the speed; each word is multiplied in and its high bits folded down, so
// that a difference in any bit reaches the result.
inline std::uint64_t content_hash(const void* data, std::size_t bytes) {
    constexpr std::uint64_t k = 0x9e3779b97f4a7c15ull;
    const auto* p = static_cast<const unsigned char*>(data);
    std::uint64_t lane[4] = {k, k + 1, k + 2, k + 3};
    const auto mix = [](std::uint64_t h, std::uint64_t w) {
        h = (h ^ w) * k;
        return h ^ (h >> 31);
    };
    std::size_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
        std::uint64_t w[4];
        std::memcpy(w, p + i, 32);
        for (int j = 0; j < 4; ++j) lane[j] = mix(lane[j], w[j]);
    }
    for (int j = 0; i < bytes; i += 8, ++j) {
        std::uint64_t w = 0;
        std::memcpy(&w, p + i, bytes - i < 8 ? bytes - i : 8);
        lane[j] = mix(lane[j], w);
    }
    return fnv1a(fnv1a(fnv1a(fnv1a(fnv1a(fnv1a_basis, bytes), lane[0]), lane[1]), lane[2]), lane[3]);
}

}  // namespace gradsync::inline v0::detail
