// The libtorch adapter on a GPU (run by bench/gpu-check.sh against the libtorch of the machine's
// PyTorch): torch models on cuda:0 trained by ranks sharing the GPU (CudaLocalBackend, each rank
// on a torch stream of its own, CudaMemory on that stream) equal one process on the whole batch,
// every rank bitwise identical after every step, with gradients kept or freed and made anew by
// torch every step; a world of one over NcclBackend, overlapped with torch's backward, equals
// plain torch bit for bit. Needs a CUDA device: without one it says so and fails.
#include <torch/torch.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <gradsync/backend/cuda_local.cuh>
#include <gradsync/backend/nccl.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/memory/cuda.cuh>
#include <gradsync/torch.hpp>

// libtorch's glog defines CHECK (which aborts); the tests mean doctest's.
#undef CHECK
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int steps = 5;
constexpr int micro_batch = 16;
constexpr int inputs = 24, hidden = 40, classes = 7;

struct NetImpl : torch::nn::Module {
    NetImpl() {
        fc1 = register_module("fc1", torch::nn::Linear(inputs, hidden));
        fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
        fc3 = register_module("fc3", torch::nn::Linear(hidden, classes));
    }
    torch::Tensor forward(torch::Tensor x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

std::mutex torch_state;  // ranks are threads of one process, sharing torch's generator

// Rank 0's weights on every call with rank 0; other ranks start from weights of their own, which
// rank 0's broadcast must replace.
Net make_net(int rank) {
    std::lock_guard lock(torch_state);
    torch::manual_seed(static_cast<std::uint64_t>(7 + rank));
    Net net;
    net->to(torch::kCUDA);
    return net;
}

struct Data {
    torch::Tensor x, y;  // on the host; each rank copies its micro-batches
    explicit Data(int world) {
        torch::manual_seed(2026);
        x = torch::randn({steps * world * micro_batch, inputs});
        y = torch::randint(classes, {steps * world * micro_batch}, torch::kLong);
    }
};

std::vector<torch::Tensor> state_of(Net& net) {
    std::vector<torch::Tensor> out;
    for (auto& p : net->parameters()) out.push_back(p.detach().to(torch::kCPU, torch::kDouble));
    return out;
}

std::uint64_t bits_hash(Net& net) {
    std::uint64_t h = 1469598103934665603ull;
    for (auto& p : net->parameters()) {
        const auto c = p.detach().to(torch::kCPU).contiguous();
        const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
        for (std::size_t i = 0; i < static_cast<std::size_t>(c.nbytes()); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
    }
    return h;
}

double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        const double diff = (a[i] - b[i]).abs().max().item<double>();
        worst = std::max(worst, diff / std::max(1.0, b[i].abs().max().item<double>()));
    }
    return worst;
}

torch::optim::SGD make_optimizer(Net& net) {
    return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// Zeroes the gradients, or frees them (zero_grad(true)) keeping the old storage alive, so that
// torch's next backward makes them at new addresses.
void clear_gradients(Net& net, bool reallocate, std::vector<torch::Tensor>& old) {
    for (auto& p : net->parameters()) {
        if (reallocate) {
            old.push_back(p.grad());
            p.mutable_grad().reset();
        } else if (p.grad().defined()) {
            p.mutable_grad().zero_();
        }
    }
}

// Plain torch on the default stream: `world` micro-batches per step as one batch.
std::vector<torch::Tensor> train_single(const Data& data, int world) {
    auto net = make_net(0);
    auto optimizer = make_optimizer(net);
    const int global = world * micro_batch;
    for (int s = 0; s < steps; ++s) {
        optimizer.zero_grad(false);
        auto x = data.x.narrow(0, s * global, global).to(torch::kCUDA);
        auto y = data.y.narrow(0, s * global, global).to(torch::kCUDA);
        torch::nn::functional::cross_entropy(net->forward(x), y).backward();
        optimizer.step();
    }
    return state_of(net);
}

}  // namespace

TEST_CASE("torch on cuda:0, ranks sharing the GPU over CudaLocalBackend, equal one process on the whole batch") {
    for (bool reallocate : {false, true}) {
        for (int world : {2, 3}) {
            CAPTURE(reallocate);
            CAPTURE(world);
            const Data data(world);
            const auto single = train_single(data, world);
            std::vector<std::vector<std::uint64_t>> hashes(static_cast<std::size_t>(world));
            std::vector<torch::Tensor> rank0;
            std::vector<std::string> failures(static_cast<std::size_t>(world));
            gradsync::cuda_local_spawn(
                world,
                [&](gradsync::CudaLocalBackend& backend) {
                    const int rank = backend.rank();
                    // This rank's torch work goes on a stream of its own; gradsync's on the same.
                    const auto stream = c10::cuda::getStreamFromPool(false, 0);
                    const c10::cuda::CUDAStreamGuard on_stream(stream);
                    backend.set_compute_stream(stream.stream());
                    auto net = make_net(rank);
                    gradsync::DataParallel dp(net, backend, gradsync::CudaMemory{stream.stream()});
                    auto optimizer = make_optimizer(net);
                    for (int s = 0; s < steps; ++s) {
                        std::vector<torch::Tensor> old;
                        clear_gradients(net, reallocate, old);
                        const auto offset = (s * world + rank) * micro_batch;
                        auto x = data.x.narrow(0, offset, micro_batch).to(torch::kCUDA);
                        auto y = data.y.narrow(0, offset, micro_batch).to(torch::kCUDA);
                        torch::nn::functional::cross_entropy(net->forward(x), y).backward();
                        if (reallocate)
                            for (std::size_t i = 0; i < old.size(); ++i)
                                if (net->parameters()[i].grad().data_ptr() == old[i].data_ptr())
                                    failures[std::size_t(rank)] = "a gradient did not move";
                        const auto report = dp.step([&] { optimizer.step(); });
                        if (!report.applied) failures[std::size_t(rank)] = "a step was skipped";
                        hashes[std::size_t(rank)].push_back(bits_hash(net));
                    }
                    if (rank == 0) rank0 = state_of(net);
                },
                gradsync::CudaLocalOptions{.timeout = std::chrono::seconds(60)});
            for (int r = 0; r < world; ++r) {
                CHECK_MESSAGE(failures[std::size_t(r)].empty(), "rank ", r, ": ", failures[std::size_t(r)]);
                CHECK_MESSAGE(hashes[std::size_t(r)] == hashes[0], "rank ", r, " differs from rank 0");
            }
            CHECK(max_relative_difference(rank0, single) <= 1e-5);
            auto start = make_net(0);
            CHECK(max_relative_difference(state_of(start), single) > 1e-3);  // training moved the weights
        }
    }
}

TEST_CASE("torch on cuda:0, a world of one over NcclBackend with overlap hooks, equals plain torch bit for bit") {
    ncclUniqueId id{};
    if (ncclGetUniqueId(&id) != ncclSuccess) throw std::runtime_error("ncclGetUniqueId failed");
    const Data data(1);
    const auto plain = train_single(data, 1);
    const auto stream = c10::cuda::getStreamFromPool(false, 0);
    const c10::cuda::CUDAStreamGuard on_stream(stream);
    gradsync::NcclBackend<> backend(0, 1, 0, id, gradsync::NcclOptions{.compute_stream = stream.stream()});
    auto net = make_net(0);
    gradsync::DataParallel dp(net, backend, gradsync::CudaMemory{stream.stream()});
    auto hooks = gradsync::libtorch::overlap(dp);
    auto optimizer = make_optimizer(net);
    for (int s = 0; s < steps; ++s) {
        optimizer.zero_grad(false);
        auto x = data.x.narrow(0, s * micro_batch, micro_batch).to(torch::kCUDA);
        auto y = data.y.narrow(0, s * micro_batch, micro_batch).to(torch::kCUDA);
        torch::nn::functional::cross_entropy(net->forward(x), y).backward();
        CHECK(hooks.reported() == std::uint64_t(s + 1) * net->parameters().size());  // from torch's backward
        const auto report = dp.step([&] { optimizer.step(); });
        CHECK(report.applied);
        CHECK(report.grad_norm > 0.0);
    }
    CHECK(max_relative_difference(state_of(net), plain) == 0.0);
}

int main(int argc, char** argv) {
    if (!torch::cuda::is_available()) {
        std::printf("FAIL: torch sees no CUDA device\n");
        return 1;
    }
    doctest::Context context(argc, argv);
    context.setOption("no-colors", true);
    return context.run();
}
