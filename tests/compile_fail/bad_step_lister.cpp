// A lister_for_step() whose object cannot list is named, rather than silently not used.
// expect: lister_for_step\(\) must return an object whose parameters_now\(\) returns
// most errors: 1
#include <gradsync/gradsync.hpp>

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(2), g = std::vector<float>(2);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
    struct Lister {
        Model* model;
#ifdef GRADSYNC_EXPECT_FAILURE
        int parameters_now() { return 1; }
#else
        std::vector<gradsync::Parameter> parameters_now() { return model->parameters(); }
#endif
    };
    Lister lister_for_step() { return {this}; }
};

int main() {
    auto ranks = gradsync::LocalBackend::create_group(1);
    Model m;
    gradsync::DataParallel dp(m, ranks[0]);
    dp.grad_ready(0);
    dp.synchronize();
}
