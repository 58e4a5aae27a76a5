// A template argument that is no policy is refused by name.
// expect: a DataParallel or ShardedDataParallel template argument after Model and Backend is not a policy
#include <gradsync/gradsync.hpp>

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
#ifdef GRADSYNC_EXPECT_FAILURE
    gradsync::DataParallel<Model, gradsync::LocalBackend, int> dp(m, ranks[0], 3);
#else
    gradsync::DataParallel<Model, gradsync::LocalBackend, gradsync::SingleBucket> dp(m, ranks[0]);
#endif
}
