// train.cpp made data-parallel: one process per rank over MPI, gradients averaged while backward
// runs. The global batch stays 64: each of N ranks trains on its 64/N examples.
//   mpirun -np 4 ./train_torch_dp
// or started by torchrun, the processes meeting through an Open MPI name server that rank 0
// starts (docs/multi-process.md):
//   torchrun --nproc_per_node 4 --no_python ./train_torch_dp
#include "net.hpp"
#include <gradsync/backend/mpi.hpp>
#include <gradsync/torch.hpp>

#include <cstdio>

int main() {
    gradsync::MpiSession mpi;  // MPI_Init_thread, and MPI_Finalize at the end
    gradsync::MpiBackend backend;
    torch::manual_seed(1);
    Net net;
    gradsync::DataParallel dp(net, backend);
    auto hooks = gradsync::libtorch::overlap(dp);
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 60; ++step) {
        auto [x, y] = make_batch(step, 64, backend.rank(), backend.size());
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
        loss.backward();
        dp.step([&] { optimizer.step(); });
        if (step % 10 == 0 && backend.rank() == 0) std::printf("step %2d  loss %.4f\n", step, loss.item<float>());
    }
}
