// DataParallel's Options given to ShardedDataParallel: refused, naming the settings type it takes.
// expect: ShardedDataParallel's run-time settings are gradsync::ShardedOptions, not gradsync::Options
// most errors: 1
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
    gradsync::ShardedDataParallel sharded(m, ranks[0], gradsync::Options{.clip_norm = 1.0});
#else
    gradsync::ShardedDataParallel sharded(m, ranks[0], gradsync::ShardedOptions{.clip_norm = 1.0});
#endif
}
