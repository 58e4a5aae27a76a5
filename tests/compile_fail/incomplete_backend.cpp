// A backend missing a member is told which one, with its signature.
// expect: a Backend needs `void barrier\(\)`
#include <gradsync/gradsync.hpp>

#include <span>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

struct Solo {  // a backend of one rank
    int rank() const { return 0; }
    int size() const { return 1; }
    bool supports(gradsync::DType) const { return true; }
    void allreduce(gradsync::Buffer, gradsync::ReduceOp) {}
    gradsync::CollectiveHandle allreduce_async(gradsync::Buffer, gradsync::ReduceOp) { return {}; }
    void broadcast(std::span<std::byte>, int) {}
#ifndef GRADSYNC_EXPECT_FAILURE
    void barrier() {}
#endif
};

int main() {
    Solo solo;
    Model m;
    gradsync::DataParallel dp(m, solo);
    dp.synchronize();
}
