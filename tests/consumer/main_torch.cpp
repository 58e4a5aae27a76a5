// Through gradsync::torch: two ranks (threads) average a libtorch module's gradients.
#include <gradsync/gradsync.hpp>
#include <gradsync/torch.hpp>

#include <cstdio>
#include <mutex>

int main() {
    float average = 0;
    std::mutex torch_state;  // libtorch's generator is shared by the threads
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        torch::nn::Linear net(nullptr);
        {
            std::lock_guard lock(torch_state);
            net = torch::nn::Linear(3, 1);
        }
        for (auto& p : net->parameters()) p.mutable_grad() = torch::zeros_like(p);
        gradsync::DataParallel dp(net, backend);
        for (auto& p : net->parameters()) p.mutable_grad().fill_(float(backend.rank() + 1));
        dp.synchronize();
        if (backend.rank() == 0) average = net->weight.grad()[0][0].item<float>();
    });
    std::printf("consumer torch ok: average %.1f\n", average);
}
