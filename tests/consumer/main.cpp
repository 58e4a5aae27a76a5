// Two ranks average a gradient: the smallest complete use of gradsync.
#ifdef CONSUME_SINGLE_HEADER
#include <gradsync.hpp>
#else
#include <gradsync/gradsync.hpp>
#endif

#include <cstdio>
#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(3), g = std::vector<float>(3);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};

int main() {
    float average = 0;
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        Model model;
        gradsync::DataParallel dp(model, backend);
        model.g.assign(3, float(backend.rank() + 1));
        dp.synchronize();
        if (backend.rank() == 0) average = model.g[0];
    });
    std::printf("consumer ok: average %.1f\n", average);
}
