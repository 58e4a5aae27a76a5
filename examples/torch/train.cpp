// A libtorch trainer, as it was before data parallelism: see train_dp.cpp for its twin.
#include "net.hpp"

#include <cstdio>

int main() {
    torch::manual_seed(1);
    Net net;
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 60; ++step) {
        auto [x, y] = make_batch(step, 64);
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
        loss.backward();
        optimizer.step();
        if (step % 10 == 0) std::printf("step %2d  loss %.4f\n", step, loss.item<float>());
    }
}
