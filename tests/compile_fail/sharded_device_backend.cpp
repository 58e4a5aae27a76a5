// ShardedDataParallel over a backend whose collectives take device memory, with the default host
// memory policy, is refused, saying which memory policy to give it (NCCL would refuse host
// buffers at the first step).
// expect: keeps its shards on the device: give it gradsync::CudaMemory\{stream\}
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
