// A model type that offers gradsync no way to list its parameters gets one readable error.
// expect: cannot list the parameters of this model type\. Provide one of
// most errors: 1
#include <gradsync/gradsync.hpp>

#include <vector>

struct Listed {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};
struct Unlisted {
    std::vector<float> w, g;
};

#ifdef GRADSYNC_EXPECT_FAILURE
using Model = Unlisted;
#else
using Model = Listed;
#endif

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel<Model, gradsync::LocalBackend> dp(m, ranks[0]);
}
