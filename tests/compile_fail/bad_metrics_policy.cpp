// A metrics policy of the user's own is refused, naming the two there are.
// expect: the metrics policy is gradsync::StepMetrics\{path, format\} or gradsync::NoMetrics
#include <gradsync/gradsync.hpp>

#include <string>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

#ifdef GRADSYNC_EXPECT_FAILURE
struct PrintMetrics {
    using policy_category = gradsync::policy_category::metrics;
    static constexpr bool on = true;
    std::string settings() const { return "print"; }
};
#else
using PrintMetrics = gradsync::StepMetrics;
#endif

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0], PrintMetrics{});
    dp.step([] {});
}
