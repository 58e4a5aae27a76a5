// A model passed by pointer (llm.c's style) gets one message saying what to write, not a
// deduction failure.
// expect: the model was passed by pointer; DataParallel takes the model itself
// most errors: 1
#include <gradsync/gradsync.hpp>

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model model;
#ifdef GRADSYNC_EXPECT_FAILURE
    gradsync::DataParallel dp(&model, ranks[0]);
#else
    gradsync::DataParallel dp(model, ranks[0]);
#endif
}
