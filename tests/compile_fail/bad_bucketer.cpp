// A bucketer whose plan() has another signature is refused, quoting the one it needs.
// expect: a bucketer policy needs a member `gradsync::BucketPlan plan\(std::span<const gradsync::Parameter> params,
// std::span<const std::size_t> order\) const`
#include <gradsync/gradsync.hpp>

#include <span>
#include <string>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

struct Everything {
    using policy_category = gradsync::policy_category::bucketer;
    std::string settings() const { return "single bucket"; }
#ifdef GRADSYNC_EXPECT_FAILURE
    gradsync::BucketPlan plan(std::span<const gradsync::Parameter> params) const {
        return gradsync::SingleBucket{}.plan(params);
    }
#else
    gradsync::BucketPlan plan(std::span<const gradsync::Parameter> params, std::span<const std::size_t> order) const {
        return gradsync::SingleBucket{}.plan(params, order);
    }
#endif
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0], Everything{});
    dp.synchronize();
}
