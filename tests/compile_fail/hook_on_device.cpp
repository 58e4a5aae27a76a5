// A communication hook with a memory policy that keeps gradients on the device is refused with a
// message that says hooks work on host memory; with host memory it compiles.
// expect: communication hooks run on gradients in host memory
// most errors: 2
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
    gradsync::DataParallel dp(m, ranks[0], Memory{}, gradsync::AllreduceHook{});
}
