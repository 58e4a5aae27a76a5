// A policy of a kind ShardedDataParallel does not take (wire compression, here) is refused with a
// message that says which kinds it takes, rather than ignored.
// expect: ShardedDataParallel takes a bucketer, a loss scaler, a buffer policy, a communication hook
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
    gradsync::ShardedDataParallel sharded(m, ranks[0], gradsync::Bf16Compression{}, gradsync::ShardedOptions{});
#else
    gradsync::ShardedDataParallel sharded(m, ranks[0], gradsync::AverageBuffers{}, gradsync::ShardedOptions{});
#endif
}
