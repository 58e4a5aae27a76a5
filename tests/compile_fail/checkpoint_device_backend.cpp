// A checkpoint of a front over a backend whose collectives take device memory, with a memory
// policy on the host (which cannot copy the tensors to the host), is refused with a message that
// names CudaMemory; with a memory policy on the device it compiles.
// expect: copies its tensors to the host through the memory policy
// most errors: 2
#include <gradsync/checkpoint/checkpoint.hpp>

#include "../support/fake_device.hpp"

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    testing_support::FakeDeviceBackend device(ranks[0]);
    Model m;
#ifdef GRADSYNC_EXPECT_FAILURE
    gradsync::DataParallel dp(m, device);
#else
    gradsync::DataParallel dp(m, device, testing_support::FakeDeviceMemory{});
#endif
    gradsync::Checkpoint().save("model.safetensors", dp);
}
