// The one hash: 64-bit FNV-1a over 64-bit words, byte by byte, so that the same values give the
// same hash in every process and on every machine (bucket plans, layouts, collective histories).
#pragma once

#include <gradsync/version.hpp>

#include <cstdint>

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

}  // namespace gradsync::inline v0::detail
