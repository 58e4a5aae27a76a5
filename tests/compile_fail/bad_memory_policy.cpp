// A memory policy without the finalize pass is refused, naming what it must have.
// expect: a memory policy needs the finalize pass
#include <gradsync/gradsync.hpp>

#include <string>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

#ifdef GRADSYNC_EXPECT_FAILURE
// Everything of HostMemory's but the finalize pass.
struct NoFinalize {
    using policy_category = gradsync::policy_category::memory;
    using Storage = gradsync::HostMemory::Storage;
    using Table = gradsync::HostMemory::Table;
    static constexpr bool on_device = false;
    std::string settings() const { return "host"; }
    Storage allocate(gradsync::Bytes size) const { return Storage(size.count()); }
    static std::byte* data(const Storage& s) { return s.data(); }
    Table table(std::span<const gradsync::Segment> segments, gradsync::DType t) const {
        return {{segments.begin(), segments.end()}, t};
    }
};
#else
struct NoFinalize : gradsync::HostMemory {};
#endif

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0], NoFinalize{});
    dp.synchronize();
}
