// A tour of the API on 2 ranks; README.md quotes the regions between the [name] markers.
#include <gradsync/gradsync.hpp>

#include <chrono>
#include <cstdio>
#include <span>
#include <vector>

using namespace gradsync::literals;

// [buffers]
struct Model {
    std::vector<float> w = std::vector<float>(1000), g = std::vector<float>(1000);
    std::vector<float> running_mean = std::vector<float>(16);  // state without a gradient

    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
    std::vector<gradsync::ModelBuffer> buffers() { return {gradsync::model_buffer("running_mean", running_mean)}; }
};
// [/buffers]

void backward(Model& m, int rank) {  // adds this micro-batch's gradient
    for (auto& g : m.g) g += float(rank + 1);
}

void data_parallel(gradsync::LocalBackend& backend) {
    Model model;
    // [data-parallel]
    gradsync::DataParallel dp(model, backend);  // the default policies
    gradsync::DataParallel capped(model, backend, gradsync::SizeCappedBuckets{.cap = 4_MiB, .first_cap = 256_KiB});
    gradsync::DataParallel<Model, gradsync::LocalBackend, gradsync::SingleBucket> single(model, backend);

    dp.synchronize();                              // after backward, on every rank: gradients := their average
    const gradsync::BucketPlan& plan = dp.plan();  // printable, comparable, hashable
    gradsync::Bytes held = dp.extra_memory();      // what it holds beyond the model
    // [/data-parallel]
    if (backend.rank() == 0)
        std::printf("%s\nextra memory %s, %zu and %zu buckets\n", gradsync::to_string(plan).c_str(),
                    gradsync::to_string(held).c_str(), capped.plan().buckets.size(), single.plan().buckets.size());
}

void accumulation(gradsync::LocalBackend& backend) {
    Model model;
    // [accumulation]
    gradsync::DataParallel dp(model, backend, gradsync::AverageBuffers{},
                              gradsync::Options{.timeout = std::chrono::seconds(30), .find_unused_parameters = true});
    for (int micro = 0; micro < 4; ++micro) {
        if (micro < 3) {
            auto guard = dp.no_sync();  // backward only accumulates; nothing is communicated
            backward(model, backend.rank());
        } else {
            backward(model, backend.rank());
            dp.synchronize();  // reduces the sum of all four micro-batches
        }
    }
    // [/accumulation]
    if (backend.rank() == 0)
        std::printf("accumulated g[0] = %.1f after %llu step\n", model.g[0], (unsigned long long)dp.steps());
}

void collectives(gradsync::LocalBackend& backend) {
    std::vector<float> v(1000, float(backend.rank()));
    // [collectives]
    backend.allreduce(std::span<float>(v), gradsync::ReduceOp::average);
    auto handle = backend.allreduce_async(std::span<float>(v));  // sum, on the rank's progress thread
    handle.wait();                                               // v must stay untouched until then
    backend.broadcast(std::span<float>(v), /*root=*/0);
    backend.barrier();
    // [/collectives]
    if (backend.rank() == 0) std::printf("v[0] = %.1f\n", v[0]);
}

int main() {
    // [local-group]
    gradsync::LocalGroupOptions options{.timeout = std::chrono::seconds(60)};
    gradsync::spawn(2, data_parallel, options);  // or: create_group(2, options), one thread per rank
    // [/local-group]
    gradsync::spawn(2, accumulation);
    gradsync::spawn(2, collectives);
}
