// A parameters() member that returns something else is named as the culprit, with the way out
// where it cannot change (model_traits), and nothing else.
// expect: Model::parameters\(\) exists but does not return a range of gradsync::Parameter.*specialize
// gradsync::model_traits<Model> most errors: 1
#include <gradsync/gradsync.hpp>

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
#ifdef GRADSYNC_EXPECT_FAILURE
    int parameters() { return 2; }
#else
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
#endif
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0]);
}
