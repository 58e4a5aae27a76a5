// Two policies of one category: the error says so and the note names both.
// expect: two policies of the same category were given to DataParallel
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
    gradsync::DataParallel dp(m, ranks[0], gradsync::SingleBucket{}, gradsync::PerParameterBuckets{});
#else
    gradsync::DataParallel dp(m, ranks[0], gradsync::SingleBucket{}, gradsync::PackedBuckets{});
#endif
}
