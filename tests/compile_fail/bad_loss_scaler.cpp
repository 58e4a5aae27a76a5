// A loss scaler without update(bool) is refused, naming the member it lacks.
// expect: a loss scaler needs `void update\(bool overflow\)`
#include <gradsync/gradsync.hpp>

#include <string>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

struct FixedScale {
    using policy_category = gradsync::policy_category::loss_scaler;
    float scale() const { return 8.0f; }
    std::string settings() const { return "fixed 8"; }
#ifndef GRADSYNC_EXPECT_FAILURE
    void update(bool) {}
#endif
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0], FixedScale{});
    return dp.loss_scale() == 8.0f ? 0 : 1;
}
