// InPlaceBuckets with a backend that only reduces contiguous buffers is refused at compile time.
// expect: InPlaceBuckets needs a backend that reduces scattered segments
#include <gradsync/gradsync.hpp>

#include <span>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

struct Contiguous {
    int rank() const { return 0; }
    int size() const { return 1; }
    bool supports(gradsync::DType) const { return true; }
    void allreduce(gradsync::Buffer, gradsync::ReduceOp) {}
    gradsync::CollectiveHandle allreduce_async(gradsync::Buffer, gradsync::ReduceOp) { return {}; }
    void broadcast(std::span<std::byte>, int) {}
    void barrier() {}
};

int main() {
    Contiguous backend;
    Model m;
#ifdef GRADSYNC_EXPECT_FAILURE
    gradsync::DataParallel dp(m, backend, gradsync::InPlaceBuckets{});
#else
    gradsync::DataParallel dp(m, backend, gradsync::PackedBuckets{});
#endif
    dp.synchronize();
}
