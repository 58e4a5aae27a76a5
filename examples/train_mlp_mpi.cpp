// The MLP trainer on several processes: one rank per process over MPI, each reading its own shard
// of the dataset, gradients averaged while backward runs, and a checkpoint it can resume from.
//
//   mpirun -np 4 ./train_mlp_mpi                              # 20 steps
//   mpirun -np 4 ./train_mlp_mpi --steps 10 --save ckpt.safetensors
//   mpirun -np 4 ./train_mlp_mpi --steps 20 --resume ckpt.safetensors   # steps 10..19
//
// Or started by torchrun, the processes meeting through an Open MPI name server that rank 0
// starts (docs/multi-process.md):
//   torchrun --nproc_per_node 4 --no_python ./train_mlp_mpi
#include "mlp.hpp"
#include <gradsync/backend/mpi.hpp>
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/gradsync.hpp>

#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

using namespace gradsync::literals;

int main(int argc, char** argv) try {
    int steps = 20;
    std::string save, resume;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string flag = argv[i];
        if (flag == "--steps") steps = std::atoi(argv[i + 1]);
        if (flag == "--save") save = argv[i + 1];
        if (flag == "--resume") resume = argv[i + 1];
    }
    // [mpi]
    gradsync::MpiSession mpi(argc, argv);              // MPI_Init_thread (and a join), MPI_Finalize at the end
    const auto place = gradsync::mpi_process_place();  // checked against the launcher's variables
    gradsync::MpiBackend backend;
    mlp::Mlp model(/*seed=*/1);  // rank 0's initial weights reach every rank at construction
    gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{.cap = 1_MiB, .first_cap = 16_KiB},
                              gradsync::LinearLr{.base_lr = 0.02, .micro_batch = 32, .warmup_steps = 5});
    model.on_grad_ready = [&dp](std::size_t index) { dp.grad_ready(index); };
    mlp::Sgd optimizer(/*lr=*/0.02f, /*momentum=*/0.9f);
    gradsync::ShardedSampler sampler(/*dataset_size=*/4096, place.world_size, place.rank, {.seed = 7});
    // [/mpi]
    // [checkpoint]
    gradsync::Checkpoint checkpoint;
    auto& velocity = optimizer.velocity(model);
    for (std::size_t p = 0; p < velocity.size(); ++p)
        checkpoint.add("optimizer.velocity." + std::to_string(p), std::span(velocity[p]));
    checkpoint.add(sampler);                           // its epoch and seed
    if (!resume.empty()) checkpoint.load(resume, dp);  // parameters, step count, sampler, optimizer
    // [/checkpoint]
    if (place.rank == 0)
        std::printf("rank 0 of %d (%d on this node), from step %llu\n", place.world_size, place.local_world_size,
                    static_cast<unsigned long long>(dp.steps()));
    const std::size_t batch = 32, per_epoch = sampler.size() / batch;
    for (auto step = dp.steps(); step < std::uint64_t(steps); step = dp.steps()) {
        if (step % per_epoch == 0) sampler.set_epoch(step / per_epoch);
        const auto indices = sampler.indices();
        mlp::Batch data;
        data.size = int(batch);
        for (std::size_t k = 0; k < batch; ++k) {
            auto one = mlp::make_batch(/*seed=*/7, indices[(step % per_epoch) * batch + k], 1);
            data.images.insert(data.images.end(), one.images.begin(), one.images.end());
            data.labels.push_back(one.labels[0]);
        }
        float loss = model.forward_backward(data);  // launches buckets as their gradients are ready
        auto report = dp.step([&](double lr) { optimizer.step(model, float(lr)); });
        if (place.rank == 0)
            std::printf("step %2llu  loss %.4f  lr %.4f\n", static_cast<unsigned long long>(step), loss,
                        report.learning_rate);
    }
    if (place.rank == 0) {  // a fingerprint of the final weights, to compare runs bit for bit
        std::uint64_t h = 14695981039346656037ull;
        for (const auto* w : {&model.w1, &model.b1, &model.w2, &model.b2})
            for (float x : *w) {
                std::uint32_t u;
                std::memcpy(&u, &x, 4);
                h = (h ^ u) * 1099511628211ull;
            }
        std::printf("weights fingerprint %016llx\n", static_cast<unsigned long long>(h));
    }
    if (!save.empty()) {
        checkpoint.save(save, dp);
        if (place.rank == 0) std::printf("saved %s\n", save.c_str());
    }
    return 0;
} catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
}
