// An LR rule without rate(world_size, step) is refused, naming the member.
// expect: an LR rule policy needs `double rate\(int world_size, std::uint64_t step\) const`
#include <gradsync/gradsync.hpp>

#include <cstdint>
#include <string>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

struct Constant {
    using policy_category = gradsync::policy_category::lr_rule;
    std::string settings() const { return "constant 0.1"; }
#ifdef GRADSYNC_EXPECT_FAILURE
    double learning_rate() const { return 0.1; }
#else
    double rate(int, std::uint64_t) const { return 0.1; }
#endif
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0], Constant{});
    dp.step([](double) {});
}
