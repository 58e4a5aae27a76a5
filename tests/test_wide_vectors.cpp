// The host reduction loops at every vector width the CPU offers give the bits of the scalar
// loop: wider vectors must never change a result, or ranks on different CPUs would drift apart.
#include <gradsync/detail/host_reduce.hpp>

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

// Runs `kernel(width, out, in, factor, n)` against `scalar(out_i, in_i, factor)` element by element.
template <class T, class Kernel, class Scalar>
void check_every_width(Kernel kernel, Scalar scalar) {
    const auto widths = widths_here();
    for (const T factor : {T(1), T(0.5), T(1) / T(3)}) {
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{15}, std::size_t{16},
                              std::size_t{17}, std::size_t{63}, std::size_t{1000}, std::size_t{4099}}) {
            for (std::size_t skew : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {  // unaligned starts
                // One element past the end, which no loop may touch.
                const auto in = values<T>(n + skew + 1, 1);
                const auto start = values<T>(n + skew + 1, 2);
                std::vector<T> expected = start;
                for (std::size_t i = skew; i < n + skew; ++i) expected[i] = scalar(start[i], in[i], factor);
                for (const auto width : widths) {
                    CAPTURE(int(width));
                    CAPTURE(n);
                    CAPTURE(skew);
                    std::vector<T> out = start;
                    kernel(width, out.data() + skew, in.data() + skew, factor, n);
                    CHECK(std::memcmp(out.data(), expected.data(), out.size() * sizeof(T)) == 0);
                }
            }
        }
    }
}

template <class T>
void check_kernels() {
    using namespace gradsync::detail;
    check_every_width<T>(
        [](VectorWidth w, T* out, const T* in, T f, std::size_t n) { run_at<AddScaled, T>(w, out, in, f, n); },
        [](T o, T i, T f) { return (o + i) * f; });
    check_every_width<T>(
        [](VectorWidth w, T* out, const T* in, T, std::size_t n) { run_at<AddInto, T>(w, out, in, n); },
        [](T o, T i, T) { return o + i; });
    check_every_width<T>(
        [](VectorWidth w, T* out, const T*, T f, std::size_t n) { run_at<ScaleInPlace, T>(w, out, f, n); },
        [](T o, T, T f) { return o * f; });
    // out = in + out, through a copy of out as the second input (AddTwo's inputs may not alias out).
    check_every_width<T>(
        [](VectorWidth w, T* out, const T* in, T, std::size_t n) {
            const std::vector<T> b(out, out + n);
            run_at<AddTwo, T>(w, out, in, b.data(), n);
        },
        [](T o, T i, T) { return i + o; });
    // Two ranks in place: out = in = (out + in) * f, and out alone.
    check_every_width<T>(
        [](VectorWidth w, T* out, const T* in, T f, std::size_t n) {
            std::vector<T> b(in, in + n + 1);  // never empty: memcmp takes no null pointer, even for 0 bytes
            run_at<SumPairInPlace<true>, T>(w, out, b.data(), out, b.data(), true, f, n);
            CHECK(std::memcmp(out, b.data(), n * sizeof(T)) == 0);
        },
        [](T o, T i, T f) { return (o + i) * f; });
    check_every_width<T>([](VectorWidth w, T* out, const T* in, T,
                            std::size_t n) { run_at<SumPairInPlace<false>, T>(w, out, in, out, out, false, T(1), n); },
                         [](T o, T i, T) { return o + i; });
}

// reduce_to_all over two inputs written in place (its one-pass path) against the same into a
// buffer apart (its general path through scratch).
template <class T>
void check_pair_in_place() {
    using gradsync::detail::reduce_to_all;
    alignas(64) static unsigned char scratch[gradsync::detail::reduce_block_bytes];
    for (const bool scaled : {false, true}) {
        for (std::size_t n : {std::size_t{1}, std::size_t{17}, std::size_t{5000}}) {
            CAPTURE(scaled);
            CAPTURE(n);
            const auto a0 = values<T>(n, 3), b0 = values<T>(n, 4);
            auto a = a0, b = b0;
            std::vector<T> apart(n);
            T* inputs[] = {a.data(), b.data()};
            T* out_apart[] = {apart.data()};
            reduce_to_all<T>(inputs, 2, out_apart, 1, n, scaled, T(0.5), scratch);
            CHECK(std::memcmp(a.data(), a0.data(), n * sizeof(T)) == 0);  // the general path wrote only its output
            T* both[] = {a.data(), b.data()};
            reduce_to_all<T>(inputs, 2, both, 2, n, scaled, T(0.5), scratch);
            CHECK(std::memcmp(a.data(), apart.data(), n * sizeof(T)) == 0);
            CHECK(std::memcmp(b.data(), apart.data(), n * sizeof(T)) == 0);
            a = a0, b = b0;
            T* second[] = {b.data()};
            reduce_to_all<T>(inputs, 2, second, 1, n, scaled, T(0.5), scratch);
            CHECK(std::memcmp(b.data(), apart.data(), n * sizeof(T)) == 0);
            CHECK(std::memcmp(a.data(), a0.data(), n * sizeof(T)) == 0);
        }
    }
}

}  // namespace

TEST_CASE("the host reduction loops give the scalar loop's bits at every vector width, float and double") {
    check_kernels<float>();
    check_kernels<double>();
}

TEST_CASE("two ranks reduced in place in one pass give the bits of the reduction through scratch") {
    check_pair_in_place<float>();
    check_pair_in_place<double>();
}

TEST_CASE("the widest vector width is one the compiler's own detection agrees the CPU has") {
    const auto widest = gradsync::detail::widest_vector_width();
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    CHECK((widest == VectorWidth::bytes64) == bool(__builtin_cpu_supports("avx512f")));
    if (widest == VectorWidth::bytes32) CHECK(__builtin_cpu_supports("avx2"));
#endif
}
