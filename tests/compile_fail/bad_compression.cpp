// A compression policy that does not say whether it compresses is refused, naming the member.
// expect: a compression policy needs `static constexpr bool compresses`
#include <gradsync/gradsync.hpp>

#include <string>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

struct Half {
    using policy_category = gradsync::policy_category::compression;
    static constexpr gradsync::DType wire = gradsync::DType::float16;
    std::string settings() const { return "float16 on the wire"; }
#ifndef GRADSYNC_EXPECT_FAILURE
    static constexpr bool compresses = true;
#endif
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0], Half{});
    dp.synchronize();
}
