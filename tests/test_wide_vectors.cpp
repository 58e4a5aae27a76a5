// The ring's reduction step at every vector width the CPU offers gives the bits of the scalar
// loop: wider vectors must never change a result, or ranks on different CPUs would drift apart.
#include <gradsync/backend/detail/wide_vectors.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using gradsync::detail::VectorWidth;

namespace {

std::vector<VectorWidth> widths_here() {
    std::vector<VectorWidth> widths{VectorWidth::bytes16};
    const auto widest = gradsync::detail::widest_vector_width();
    if (widest >= VectorWidth::bytes32) widths.push_back(VectorWidth::bytes32);
    if (widest >= VectorWidth::bytes64) widths.push_back(VectorWidth::bytes64);
    return widths;
}

// Values that tell roundings apart: random magnitudes over many exponents, subnormals,
// signed zeros, infinities and a NaN.
template <class T>
std::vector<T> values(std::size_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<T> mantissa(-1, 1);
    std::uniform_int_distribution<int> exponent(-30, 30);
    std::vector<T> v(n);
    for (auto& x : v) x = std::ldexp(mantissa(rng), exponent(rng));
    const T specials[] = {std::numeric_limits<T>::denorm_min(), -std::numeric_limits<T>::min() / 3, T(-0.0),
                          std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN()};
    for (std::size_t i = 0; i < std::size(specials) && i * 7 < n; ++i) v[i * 7] = specials[i];
    return v;
}

template <class T>
void check_every_width() {
    const auto widths = widths_here();
    for (const T factor : {T(1), T(0.5), T(1) / T(3)}) {
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{15}, std::size_t{16},
                              std::size_t{17}, std::size_t{63}, std::size_t{1000}, std::size_t{4099}}) {
            for (std::size_t skew : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {  // unaligned starts
                const auto in = values<T>(n + skew, 1);
                const auto start = values<T>(n + skew, 2);
                std::vector<T> expected = start;
                for (std::size_t i = skew; i < n + skew; ++i) expected[i] = (start[i] + in[i]) * factor;
                for (const auto width : widths) {
                    CAPTURE(int(width));
                    CAPTURE(n);
                    CAPTURE(skew);
                    std::vector<T> out = start;
                    gradsync::detail::add_scaled_at(width, out.data() + skew, in.data() + skew, factor, n);
                    CHECK(std::memcmp(out.data(), expected.data(), out.size() * sizeof(T)) == 0);
                }
            }
        }
    }
}

}  // namespace

TEST_CASE("the reduction step gives the scalar loop's bits at every vector width, float and double") {
    check_every_width<float>();
    check_every_width<double>();
}

TEST_CASE("the widest vector width is one the compiler's own detection agrees the CPU has") {
    const auto widest = gradsync::detail::widest_vector_width();
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    CHECK((widest == VectorWidth::bytes64) == bool(__builtin_cpu_supports("avx512f")));
    if (widest == VectorWidth::bytes32) CHECK(__builtin_cpu_supports("avx2"));
#endif
}
