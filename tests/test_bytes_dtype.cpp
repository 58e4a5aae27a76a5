// Bytes (typed sizes and their literals) and DType (run-time element types).
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>

#include <doctest/doctest.h>

#include <sstream>

using namespace gradsync::literals;
using gradsync::Bytes;
using gradsync::DType;

TEST_CASE("Bytes literals use binary units") {
    CHECK((1_KiB).count() == 1024);
    CHECK((25_MiB).count() == 25ull * 1024 * 1024);
    CHECK((2_GiB).count() == 2ull << 30);
    CHECK(1_MiB == 1024_KiB);
    CHECK(1_MiB + 1_KiB == Bytes{1049600});
    CHECK(3 * 1_KiB == 3072_B);
    CHECK(1_KiB < 1_MiB);
}

TEST_CASE("Bytes print with one decimal at most") {
    CHECK(gradsync::to_string(512_B) == "512 B");
    CHECK(gradsync::to_string(1_KiB) == "1 KiB");
    CHECK(gradsync::to_string(1536_KiB) == "1.5 MiB");
    CHECK(gradsync::to_string(25_MiB) == "25 MiB");
    CHECK(gradsync::to_string(Bytes{102228128}) == "97.5 MiB");
    std::ostringstream os;
    os << 4_GiB;
    CHECK(os.str() == "4 GiB");
}

TEST_CASE("DType sizes and names") {
    CHECK(gradsync::size_of(DType::float32) == 4);
    CHECK(gradsync::size_of(DType::float64) == 8);
    CHECK(gradsync::size_of(DType::float16) == 2);
    CHECK(gradsync::size_of(DType::bfloat16) == 2);
    CHECK(gradsync::to_string(DType::bfloat16) == "bfloat16");
    auto bogus = static_cast<DType>(42);
    CHECK_FALSE(gradsync::is_known(bogus));
    CHECK(gradsync::size_of(bogus) == 0);
    CHECK(gradsync::to_string(bogus) == "dtype(42)");
    static_assert(gradsync::dtype_of<float> == DType::float32);
    static_assert(gradsync::dtype_of<const double> == DType::float64);
    static_assert(gradsync::dtype_of<std::int64_t> == DType::int64);
    static_assert(!gradsync::HasDType<char>);
    CHECK(gradsync::size_of(DType::int32) == 4);
    CHECK(gradsync::to_string(DType::int64) == "int64");
}
