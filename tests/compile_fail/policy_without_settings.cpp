// A policy that does not say its settings is refused: the ranks could not agree on it, and two
// ranks given different ones would train apart.
// expect: a policy needs `std::string settings\(\) const`
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
    double rate(int, std::uint64_t) const { return 0.1; }
#ifndef GRADSYNC_EXPECT_FAILURE
    std::string settings() const { return "constant 0.1"; }
#endif
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0], Constant{});
    dp.step([](double) {});
}
