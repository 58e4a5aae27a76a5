// Bytes: a typed memory size, so that no size in the API is a bare number whose unit a user
// must guess. Literals 4_KiB, 25_MiB, 1_GiB live in gradsync::literals.
#pragma once

#include <gradsync/version.hpp>

#include <compare>  // for operator<=>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>

namespace gradsync::inline v0 {

class Bytes {
public:
    constexpr Bytes() = default;
    constexpr explicit Bytes(std::uint64_t count) : count_(count) {}

    [[nodiscard]] constexpr std::uint64_t count() const { return count_; }

    // == declared as well as implied: nvcc's host pass otherwise leaves the implied one undefined.
    friend constexpr bool operator==(Bytes, Bytes) = default;
    friend constexpr auto operator<=>(Bytes, Bytes) = default;
    friend constexpr Bytes operator+(Bytes a, Bytes b) { return Bytes{a.count_ + b.count_}; }
    friend constexpr Bytes operator-(Bytes a, Bytes b) { return Bytes{a.count_ - b.count_}; }
    friend constexpr Bytes operator*(Bytes a, std::uint64_t k) { return Bytes{a.count_ * k}; }
    friend constexpr Bytes operator*(std::uint64_t k, Bytes a) { return Bytes{a.count_ * k}; }
    constexpr Bytes& operator+=(Bytes b) {
        count_ += b.count_;
        return *this;
    }

private:
    std::uint64_t count_ = 0;
};

// "1.5 MiB", "512 B": binary units, at most one decimal.
inline std::string to_string(Bytes b) {
    static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    auto value = static_cast<double>(b.count());
    int unit = 0;
    while (value >= 1024.0 && unit < 4) {
        value /= 1024.0;
        ++unit;
    }
    // Appends one piece at a time: g++ 12 at -O3 warns (-Wrestrict) on `"." + std::to_string(x)`.
    std::string text = std::to_string(unit == 0 ? b.count() : static_cast<std::uint64_t>(value * 10.0 + 0.5) / 10);
    if (unit != 0) {
        auto tenths = static_cast<std::uint64_t>(value * 10.0 + 0.5) % 10;
        if (tenths != 0) {
            text.push_back('.');
            text.push_back(static_cast<char>('0' + tenths));
        }
    }
    text.push_back(' ');
    text.append(units[unit]);
    return text;
}

inline std::ostream& operator<<(std::ostream& os, Bytes b) { return os << to_string(b); }

namespace literals {
constexpr Bytes operator""_B(unsigned long long n) { return Bytes{n}; }
constexpr Bytes operator""_KiB(unsigned long long n) { return Bytes{n << 10}; }
constexpr Bytes operator""_MiB(unsigned long long n) { return Bytes{n << 20}; }
constexpr Bytes operator""_GiB(unsigned long long n) { return Bytes{n << 30}; }
}  // namespace literals

}  // namespace gradsync::inline v0
