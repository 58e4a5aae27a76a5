// ShardedDataParallel over a backend whose collectives take device memory is refused, saying what
// to use instead (it keeps everything in host memory, which NCCL refuses at the first step).
// expect: ShardedDataParallel keeps parameters, gradients and optimizer shards in host memory
// most errors: 1
#include <gradsync/gradsync.hpp>

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

// LocalBackend's collectives, said to take device memory (as NcclBackend's do).
struct OnDevice : gradsync::LocalBackend {
#ifdef GRADSYNC_EXPECT_FAILURE
    static constexpr bool device_memory = true;
#endif
};

int main() {
    auto train = [](OnDevice& backend) {
        Model m;
        gradsync::ShardedDataParallel sharded(m, backend);
        sharded.step([](auto&&...) {});
    };
    (void)train;
}
