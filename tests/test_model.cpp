// Model access: the three tiers of the gradsync::parameters customization point, the parameter()
// helpers, and the contiguous-blob adapter for llm.c-style models.
#include <gradsync/model/contiguous_parameters.hpp>
#include <gradsync/model/model.hpp>

#include <doctest/doctest.h>

#include <array>
#include <string_view>
#include <vector>

namespace {

// Tier 2: a member function.
struct WithMember {
    std::vector<float> w = std::vector<float>(6), gw = std::vector<float>(6);
    std::vector<double> b = std::vector<double>(2), gb = std::vector<double>(2);
    std::vector<gradsync::Parameter> parameters() {
        return {gradsync::parameter("w", w, gw), gradsync::parameter("b", b, gb)};
    }
};

}  // namespace

// Tier 3: a free function found by ADL, for a type the user cannot change.
namespace thirdparty {
struct Frozen {
    std::array<float, 3> w{}, gw{};
};
inline std::vector<gradsync::Parameter> parameters(Frozen& f) { return {gradsync::parameter("frozen.w", f.w, f.gw)}; }

// Has both a member and an ADL function: the member wins.
struct Both {
    float w[2]{}, gw[2]{};
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("member", w, gw, 2)}; }
};
inline std::vector<gradsync::Parameter> parameters(Both& b) { return {gradsync::parameter("adl", b.w, b.gw, 2)}; }
}  // namespace thirdparty

// Tier 1: a model_traits specialization, which wins over a member.
struct Traited {
    float w[4]{}, gw[4]{};
    std::vector<gradsync::Parameter> parameters() { return {}; }
};
template <>
struct gradsync::model_traits<Traited> {
    static std::array<gradsync::Parameter, 1> parameters(Traited& t) {
        return {gradsync::parameter("traits.w", t.w, t.gw, 4)};
    }
};

struct Bare {
    std::vector<float> w;
};

static_assert(gradsync::ModelAccess<WithMember>);
static_assert(gradsync::ModelAccess<thirdparty::Frozen>);
static_assert(gradsync::ModelAccess<Traited>);
static_assert(gradsync::ModelAccess<gradsync::ContiguousParameters<float>>);
static_assert(!gradsync::ModelAccess<Bare>);

TEST_CASE("a member parameters() lists the model's tensors") {
    WithMember m;
    auto params = gradsync::parameters(m);
    REQUIRE(params.size() == 2);
    CHECK(params[0].name == "w");
    CHECK(params[0].data == m.w.data());
    CHECK(params[0].grad == m.gw.data());
    CHECK(params[0].count == 6);
    CHECK(params[0].dtype == gradsync::DType::float32);
    CHECK(params[0].bytes() == gradsync::Bytes{24});
    CHECK(params[1].dtype == gradsync::DType::float64);
    CHECK(params[1].bytes() == gradsync::Bytes{16});
}

TEST_CASE("a free function found by ADL adapts a type the user cannot change") {
    thirdparty::Frozen f;
    auto params = gradsync::parameters(f);
    REQUIRE(params.size() == 1);
    CHECK(params[0].name == "frozen.w");
    CHECK(params[0].data == f.w.data());
    CHECK(params[0].count == 3);
}

TEST_CASE("model_traits wins over a member, and a member over ADL") {
    Traited t;
    auto params = gradsync::parameters(t);
    REQUIRE(params.size() == 1);
    CHECK(params[0].name == "traits.w");

    thirdparty::Both b;
    auto both = gradsync::parameters(b);
    REQUIRE(both.size() == 1);
    CHECK(both[0].name == "member");
}

TEST_CASE("parameter() refuses value and gradient buffers of different sizes") {
    std::vector<float> w(4), g(3);
    CHECK_THROWS_WITH_AS(gradsync::parameter("fc.w", w, g),
                         doctest::Contains("parameter 'fc.w' has 4 values but 3 gradient elements"),
                         gradsync::InvalidModel);
}

TEST_CASE("ContiguousParameters cuts two blobs by a table of sizes") {
    // llm.c keeps a table like this one next to params_memory and grads_memory.
    const std::size_t sizes[] = {6, 0, 3, 5};
    const std::string_view names[] = {"wte", "empty", "ln1w", "qkvw"};
    std::vector<float> params(14), grads(14);
    gradsync::ContiguousParameters<float> blob(params.data(), grads.data(), sizes, names);
    CHECK(blob.total_count() == 14);

    auto list = gradsync::parameters(blob);
    REQUIRE(list.size() == 4);
    CHECK(list[0].name == "wte");
    CHECK(list[0].data == params.data());
    CHECK(list[1].count == 0);
    CHECK(list[2].name == "ln1w");
    CHECK(list[2].data == params.data() + 6);
    CHECK(list[2].grad == grads.data() + 6);
    CHECK(list[3].data == params.data() + 9);
    CHECK(list[3].count == 5);

    gradsync::ContiguousParameters<float> unnamed(params.data(), grads.data(), sizes);
    CHECK(gradsync::parameters(unnamed)[3].name == "param3");

    const std::string_view too_few[] = {"a"};
    CHECK_THROWS_WITH_AS(gradsync::ContiguousParameters<float>(params.data(), grads.data(), sizes, too_few),
                         doctest::Contains("got 4 tensor sizes but 1 names"), gradsync::InvalidModel);
}
