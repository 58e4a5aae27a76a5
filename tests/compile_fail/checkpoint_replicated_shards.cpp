// A checkpoint of a ShardedDataParallel whose shards are replicated across nodes (over
// TwoLevelBackend) is refused where it is written, naming what can be saved; sharded over a flat
// backend it compiles.
// expect: cannot save or load a ShardedDataParallel whose shards are replicated
// most errors: 2
#include <gradsync/backend/local.hpp>
#include <gradsync/backend/two_level.hpp>
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

int main() {
    auto node = gradsync::LocalBackend::create_group(1);
    auto across = gradsync::LocalBackend::create_group(1);
    Model m;
#ifdef GRADSYNC_EXPECT_FAILURE
    gradsync::TwoLevelBackend backend(node[0], across[0]);
#else
    auto& backend = node[0];
#endif
    gradsync::ShardedDataParallel dp(m, backend, gradsync::ShardedOptions{});
    gradsync::Checkpoint().save("model.safetensors", dp);
}
