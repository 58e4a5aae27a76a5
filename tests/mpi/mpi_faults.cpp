// Failure propagation across processes: `mpi_faults <scenario>` trains the example MLP on every
// rank, and rank 1 misbehaves in step 3. Every scenario must end the whole job, with a nonzero
// status and a message that names the culprit, well before the test's time limit; a hang fails.
//   throw    rank 1 reports a gradient twice: its ReadinessError aborts the job
//   missing  rank 1 never reports one parameter: the error names it and the step
//   exit     rank 1 exits without a word: the launcher ends the others
//   hang     rank 1 stops calling collectives: the others' deadline (2 s here) ends the job,
//            and their message says where rank 1 stands (between steps)
//   stuck    rank 1 stops in its backward, one gradient short: the message names the parameter
//   stop     rank 1 stops itself (SIGSTOP): the message says it did not answer
//   leave    rank 1 catches an exception of its own and returns from main cleanly, while the
//            others wait in step 3's collectives: they learn at once (their deadline is 60 s here)
//   alone    (started torchrun-style as rank 0 of 2, with no rank 1) the join's deadline, 10 s here
//   sharded-leave  as leave, under ShardedDataParallel, whose reduce_scatters rank 1's backward
//            launched before it threw: destroyed with them in flight, it tells the others at once
//   train-on every rank trains for up to 10 minutes and nobody misbehaves: the failure comes from
//            outside (scripts/nodes.py cutting a node's link); the deadline is 2 s
#include <gradsync/backend/mpi.hpp>
#include <gradsync/gradsync.hpp>

#include "mlp.hpp"

#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <span>
#include <thread>

namespace {

// Rank 1 throws in the backward of step 3, after its first gradients launched their buckets'
// reduce_scatters; the exception destroys its ShardedDataParallel with them in flight.
int sharded_leave(gradsync::MpiBackend& backend) {
    mlp::Mlp model(1);
    int step = 0;
    try {
        gradsync::ShardedDataParallel sdp(model, backend, gradsync::PerParameterBuckets{},
                                          gradsync::ShardedOptions{.timeout = std::chrono::seconds(60)});
        model.on_grad_ready = [&](std::size_t i) {
            sdp.grad_ready(i);
            if (backend.rank() == 1 && step == 3 && i == 2) throw std::runtime_error("the loss went missing");
        };
        auto sgd = [](std::span<const gradsync::ShardPiece<float>> pieces) {
            for (const auto& piece : pieces)
                for (std::size_t k = 0; k < piece.params.size(); ++k) piece.params[k] -= 0.05f * piece.grads[k];
        };
        for (step = 0; step < 6; ++step) {
            model.forward_backward(mlp::make_batch(1, std::size_t(step * 64 + backend.rank() * 16), 16));
            (void)sdp.step(sgd);
        }
    } catch (const std::runtime_error& e) {
        std::printf("rank %d stops training: %s\n", backend.rank(), e.what());
        return 0;
    }
    std::printf("rank %d finished all steps\n", backend.rank());
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    gradsync::MpiSession mpi(argc, argv, /*join_timeout=*/std::chrono::seconds(10));
    const std::string scenario = argc > 1 ? argv[1] : "";
    if (scenario != "throw" && scenario != "missing" && scenario != "exit" && scenario != "hang" &&
        scenario != "stuck" && scenario != "stop" && scenario != "leave" && scenario != "sharded-leave" &&
        scenario != "train-on") {
        std::fprintf(stderr,
                     "usage: mpi_faults throw|missing|exit|hang|stuck|stop|leave|sharded-leave|train-on|alone\n");
        return 2;
    }
    gradsync::MpiOptions options;
    const auto timeout = std::chrono::seconds(scenario == "leave" || scenario == "sharded-leave" ? 60 : 2);
    options.timeout = timeout;
    gradsync::MpiBackend backend(gradsync::mpi_world(), options);
    if (scenario == "sharded-leave") return sharded_leave(backend);
    mlp::Mlp model(1);
    gradsync::DataParallel dp(model, backend, gradsync::PerParameterBuckets{}, gradsync::Options{.timeout = timeout});
    const bool culprit = backend.rank() == 1;
    int step = 0;
    model.on_grad_ready = [&](std::size_t i) {
        if (culprit && step == 3 && scenario == "missing" && i == 1) return;  // parameter "fc1.bias"
        if (culprit && step == 3 && scenario == "stuck" && i == 1)
            std::this_thread::sleep_for(std::chrono::seconds(600));
        dp.grad_ready(i);
        if (culprit && step == 3 && scenario == "throw" && i == 3) dp.grad_ready(i);
    };
    mlp::Sgd optimizer(0.05f, 0.9f);
    try {
        const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(10);
        const int steps = scenario == "train-on" ? 1 << 30 : 6;
        for (step = 0; step < steps && std::chrono::steady_clock::now() < until; ++step) {
            if (culprit && step == 3 && scenario == "exit") std::_Exit(0);
            if (culprit && step == 3 && scenario == "hang") std::this_thread::sleep_for(std::chrono::seconds(600));
            if (culprit && step == 3 && scenario == "stop") std::raise(SIGSTOP);
            if (culprit && step == 3 && scenario == "leave") throw std::runtime_error("the data loader failed");
            model.forward_backward(mlp::make_batch(1, std::size_t(step * 64 + backend.rank() * 16), 16));
            dp.synchronize();
            optimizer.step(model);
            if (scenario == "train-on" && step == 0) {
                std::printf("rank %d trains\n", backend.rank());
                std::fflush(stdout);
            }
        }
    } catch (const std::runtime_error& e) {
        std::printf("rank %d stops training: %s\n", backend.rank(), e.what());
        return 0;
    }
    std::printf("rank %d finished all steps\n", backend.rank());
    return 0;
}
