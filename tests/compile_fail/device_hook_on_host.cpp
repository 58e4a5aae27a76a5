// A communication hook that computes on the device (CudaPowerSGD, say), with a memory policy that
// keeps the gradients on the host, is refused with a message that names the fix; with a memory
// policy on the device it compiles.
// expect: this communication hook computes on the device, and this memory policy keeps the gradients on the host
// most errors: 2
#include <gradsync/gradsync.hpp>

#include "../support/fake_device.hpp"

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

// Hands the values to its collective; declares it computes on the device (its kernels would go
// on bucket.stream).
struct DeviceHook {
    using policy_category = gradsync::policy_category::comm_hook;
    static constexpr bool hooked = true;
    static constexpr bool on_device = true;
    [[nodiscard]] std::string settings() const { return "on the device"; }
    gradsync::HookComm::Pending start(const gradsync::HookBucket& bucket, gradsync::HookComm& comm) {
        return comm.allreduce_async(bucket.values, gradsync::ReduceOp::average);
    }
    void finish(const gradsync::HookBucket&, gradsync::HookComm&) {}
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
#ifdef GRADSYNC_EXPECT_FAILURE
    gradsync::DataParallel dp(m, ranks[0], DeviceHook{});
#else
    testing_support::FakeDeviceBackend device(ranks[0]);
    gradsync::DataParallel dp(m, device, testing_support::FakeDeviceMemory{}, DeviceHook{});
#endif
}
