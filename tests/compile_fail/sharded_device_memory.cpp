// A device memory policy given to ShardedDataParallel over a backend whose collectives take host
// memory is refused with a message that names the backend it needs; a host memory policy compiles.
// expect: a device memory policy \(CudaMemory\) needs a backend whose collectives take device memory
// most errors: 1
#include <gradsync/gradsync.hpp>

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

#ifdef GRADSYNC_EXPECT_FAILURE
struct Memory : gradsync::HostMemory {
    static constexpr bool on_device = true;
};
#else
struct Memory : gradsync::HostMemory {};
#endif

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::ShardedDataParallel sharded(m, ranks[0], Memory{});
}
