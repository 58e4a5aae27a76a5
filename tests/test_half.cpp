// float16 and bfloat16: conversions round to nearest even, checked against the compiler's
// _Float16 for binary16 and against a rounding worked out in double for bfloat16.
#include <gradsync/half.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using gradsync::bfloat16;
using gradsync::float16;

namespace {

std::uint16_t reference_half(float f) {
    auto h = static_cast<_Float16>(f);  // g++'s conversion rounds to nearest even
    std::uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}

float from_bits(std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// The bfloat16 nearest to f, ties to the even one, by comparing both neighbours in double.
std::uint16_t reference_bfloat16(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) == 0x7f800000u) return static_cast<std::uint16_t>(u >> 16);  // infinities
    const std::uint32_t down = u & 0xffff0000u, up = down + 0x10000u;
    const double lo = from_bits(down);
    // Past the largest finite value the next one up is 2^128, as IEEE rounding has it.
    const double hi =
        (up & 0x7f800000u) == 0x7f800000u ? std::copysign(std::ldexp(1.0, 128), double(f)) : double(from_bits(up));
    const double dl = std::fabs(double(f) - lo), dh = std::fabs(hi - double(f));
    if (dl < dh) return static_cast<std::uint16_t>(down >> 16);
    if (dh < dl) return static_cast<std::uint16_t>(up >> 16);
    return static_cast<std::uint16_t>(((down >> 16) & 1u) ? up >> 16 : down >> 16);
}

std::vector<float> interesting_floats() {
    std::vector<float> v{0.0f,
                         -0.0f,
                         1.0f,
                         -1.0f,
                         65504.0f,
                         65519.0f,
                         65520.0f,
                         65535.0f,
                         65536.0f,
                         1e-8f,
                         5.96e-8f,
                         2.98e-8f,
                         6.1e-5f,
                         6.097e-5f,
                         1e30f,
                         -1e30f,
                         3.0e38f,
                         -3.0e38f,
                         1.0000001f,
                         0.33333334f,
                         1.0009766f,
                         1.0014648f,
                         2049.0f,
                         4097.0f,
                         std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity(),
                         std::numeric_limits<float>::denorm_min(),
                         std::numeric_limits<float>::min()};
    std::mt19937 rng(16);
    std::uniform_int_distribution<std::uint32_t> bits;
    for (int i = 0; i < 200000; ++i) {
        float f = from_bits(bits(rng));
        if (!std::isnan(f)) v.push_back(f);
    }
    // Exact halfway points between neighbouring binary16 values, where ties must go to even.
    for (std::uint32_t h = 0; h < 0x7c00; h += 7) {
        float a = gradsync::detail::float_from_half_bits(static_cast<std::uint16_t>(h));
        float b = gradsync::detail::float_from_half_bits(static_cast<std::uint16_t>(h + 1));
        v.push_back(static_cast<float>((double(a) + double(b)) / 2));
    }
    return v;
}

}  // namespace

TEST_CASE("float16 from float rounds to nearest even, like the compiler's _Float16") {
    int wrong = 0;
    for (float f : interesting_floats()) {
        if (float16(f).bits != reference_half(f)) {
            if (++wrong < 5) CAPTURE(f);
        }
    }
    CHECK(wrong == 0);
    CHECK(float16(65519.0f).bits == 0x7bff);         // the largest finite
    CHECK(float16(65520.0f).bits == 0x7c00);         // a tie that rounds up to infinity
    CHECK(float16(-2.98023224e-8f).bits == 0x8000);  // half the smallest subnormal: ties to even zero
    CHECK(std::isnan(static_cast<float>(float16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST_CASE("every float16 converts to float and back to itself") {
    int wrong = 0;
    for (std::uint32_t h = 0; h < 0x10000; ++h) {
        auto x = float16::from_bits(static_cast<std::uint16_t>(h));
        float f = static_cast<float>(x);
        bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0;
        if (nan) {
            wrong += !std::isnan(f);
            continue;
        }
        _Float16 ref;
        std::uint16_t b = static_cast<std::uint16_t>(h);
        std::memcpy(&ref, &b, 2);
        wrong += float16(f).bits != h;
        wrong += f != static_cast<float>(ref);
    }
    CHECK(wrong == 0);
}

TEST_CASE("bfloat16 from float rounds to nearest even") {
    int wrong = 0;
    for (float f : interesting_floats()) wrong += bfloat16(f).bits != reference_bfloat16(f);
    CHECK(wrong == 0);
    CHECK(bfloat16(1.00390625f).bits == 0x3f80);  // halfway between 1 and its successor: even (down)
    CHECK(bfloat16(1.01171875f).bits == 0x3f82);  // halfway above an odd mantissa: up to even
    CHECK(bfloat16(3.0e38f).bits == 0x7f62);
    CHECK(std::isnan(static_cast<float>(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
    int roundtrip_wrong = 0;
    for (std::uint32_t h = 0; h < 0x10000; ++h) {
        float f = static_cast<float>(bfloat16::from_bits(static_cast<std::uint16_t>(h)));
        if (!std::isnan(f)) roundtrip_wrong += bfloat16(f).bits != h;
    }
    CHECK(roundtrip_wrong == 0);
}

TEST_CASE("the 16-bit types have their DTypes") {
    static_assert(gradsync::dtype_of<float16> == gradsync::DType::float16);
    static_assert(gradsync::dtype_of<bfloat16> == gradsync::DType::bfloat16);
    static_assert(sizeof(float16) == 2 && sizeof(bfloat16) == 2);
    CHECK(static_cast<float>(float16(0.5f)) == 0.5f);
    CHECK(static_cast<float>(bfloat16(-2.0f)) == -2.0f);
}

TEST_CASE("bulk conversions (F16C where the processor has it) agree with the element-wise ones") {
    std::vector<float16> all(0x10000);
    for (std::uint32_t h = 0; h < 0x10000; ++h) all[h] = float16::from_bits(static_cast<std::uint16_t>(h));
    std::vector<float> wide(all.size());
    gradsync::detail::widen_to_float(all.data(), wide.data(), all.size());
    int wrong = 0;
    for (std::size_t i = 0; i < all.size(); ++i) {
        float one = static_cast<float>(all[i]);
        wrong += std::isnan(one) ? !std::isnan(wide[i]) : std::memcmp(&one, &wide[i], 4) != 0;
    }
    CHECK(wrong == 0);

    auto floats = interesting_floats();
    floats.push_back(std::numeric_limits<float>::quiet_NaN());
    std::vector<float16> narrow(floats.size());
    gradsync::detail::narrow_from_float(floats.data(), narrow.data(), floats.size());
    std::vector<gradsync::bfloat16> narrow_b(floats.size());
    gradsync::detail::narrow_from_float(floats.data(), narrow_b.data(), floats.size());
    wrong = 0;
    for (std::size_t i = 0; i < floats.size(); ++i) {
        if (std::isnan(floats[i])) {
            wrong += !std::isnan(static_cast<float>(narrow[i])) + !std::isnan(static_cast<float>(narrow_b[i]));
        } else {
            wrong += narrow[i].bits != float16(floats[i]).bits;
            wrong += narrow_b[i].bits != bfloat16(floats[i]).bits;
        }
    }
    CHECK(wrong == 0);
}

TEST_CASE("bulk bfloat16 conversions (in blocks) agree with the element-wise ones, at every length") {
    std::vector<bfloat16> all(0x10000);
    for (std::uint32_t h = 0; h < 0x10000; ++h) all[h] = bfloat16::from_bits(static_cast<std::uint16_t>(h));
    auto floats = interesting_floats();
    floats.push_back(std::numeric_limits<float>::quiet_NaN());
    floats.push_back(-std::numeric_limits<float>::infinity());
    // Lengths below a block, at one, and with a tail; starting at an odd offset too.
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{63}, std::size_t{64}, std::size_t{65},
                          std::size_t{200}, all.size() - 3}) {
        CAPTURE(n);
        std::vector<float> wide(n + 1, -1.0f);
        gradsync::detail::widen_to_float(all.data() + 3, wide.data() + 1, n);
        int wrong = 0;
        for (std::size_t i = 0; i < n; ++i) {
            const float one = static_cast<float>(all[i + 3]);
            wrong += std::memcmp(&one, &wide[i + 1], 4) != 0;  // NaNs keep their payload: compare bits
        }
        CHECK(wrong == 0);
        CHECK(wide[0] == -1.0f);  // nothing written before the array

        const std::size_t m = std::min(n, floats.size());
        std::vector<bfloat16> narrow(m + 1, bfloat16::from_bits(0x1234));
        std::vector<float> written(m);
        gradsync::detail::narrow_to_bfloat16(floats.data(), narrow.data(), m, written.data());
        wrong = 0;
        for (std::size_t i = 0; i < m; ++i) {
            const bfloat16 one(floats[i]);
            wrong += narrow[i].bits != one.bits;
            const float back = static_cast<float>(one);
            wrong += std::memcmp(&back, &written[i], 4) != 0;
        }
        CHECK(wrong == 0);
        CHECK(narrow[m].bits == 0x1234);  // nothing written past the end
    }
}
