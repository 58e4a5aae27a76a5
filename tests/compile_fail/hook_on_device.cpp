// A communication hook that reads the gradients on the host, with a memory policy that keeps them
// on the device, is refused with a message that says how a hook that does not read them declares
// it; with host memory it compiles.
// expect: this communication hook reads the gradients on the host
// most errors: 2
#include <gradsync/gradsync.hpp>

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

// Halves what the allreduce summed, on the host: it reads the values (no `reads_values = false`).
struct HalvingHook {
    using policy_category = gradsync::policy_category::comm_hook;
    static constexpr bool hooked = true;
    [[nodiscard]] std::string settings() const { return "halving"; }
    gradsync::HookComm::Pending start(const gradsync::HookBucket& bucket, gradsync::HookComm& comm) {
        return comm.allreduce_async(bucket.values, gradsync::ReduceOp::sum);
    }
    void finish(const gradsync::HookBucket& bucket, gradsync::HookComm&) {
        for (float& v : bucket.values) v /= 2.0f;
    }
};

#ifdef GRADSYNC_EXPECT_FAILURE
struct Memory : gradsync::HostMemory {
    static constexpr bool on_device = true;
};
#else
struct Memory : gradsync::HostMemory {};
#endif

int main() {
    auto ranks = gradsync::LocalBackend::create_group(2);
    Model m;
    gradsync::DataParallel dp(m, ranks[0], Memory{}, HalvingHook{});
}
