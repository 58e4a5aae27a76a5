// The libtorch side of the checkpoint round trip with Python (checkpoint_interop.py drives it):
//   write DIR   trains a small libtorch model (Linear, BatchNorm1d, Linear) on 2 ranks for a few
//               steps, saves a gradsync checkpoint to DIR/gradsync.safetensors and writes the
//               model's eval-mode output on a fixed input to DIR/gradsync_output.bin
//   read DIR    loads DIR/python.safetensors (a state dict Python's safetensors wrote) into the
//               same model through gradsync (Checkpoint::load_weights, on 2 ranks) and checks its
//               output against DIR/python_output.bin
// Exit status 0 when it did what it says, 1 with a message otherwise.
#include <torch/torch.h>

#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/gradsync.hpp>
#include <gradsync/torch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int inputs = 6, hidden = 5, classes = 3, batch = 4;

struct NetImpl : torch::nn::Module {
    NetImpl() {
        fc1 = register_module("fc1", torch::nn::Linear(inputs, hidden));
        bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
        fc2 = register_module("fc2", torch::nn::Linear(hidden, classes));
    }
    torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
    torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

// The input both sides evaluate: 0.1 * (i - 10) for element i, row-major [batch, inputs].
torch::Tensor probe() {
    return (torch::arange(batch * inputs, torch::kFloat32) - 10.0f).mul(0.1f).reshape({batch, inputs});
}

std::vector<float> output_of(Net& net) {
    torch::NoGradGuard no_grad;
    net->eval();
    auto out = net->forward(probe()).contiguous();
    return {out.data_ptr<float>(), out.data_ptr<float>() + out.numel()};
}

void write_floats(const std::filesystem::path& path, const std::vector<float>& v) {
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    if (!f) throw std::runtime_error("cannot write " + path.string());
}

std::vector<float> read_floats(const std::filesystem::path& path) {
    std::ifstream f(path, std::ios::binary);
    std::vector<float> v(static_cast<std::size_t>(batch * classes));
    f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    if (!f) throw std::runtime_error("cannot read " + path.string());
    return v;
}

std::mutex torch_state;  // the ranks are threads of one process, sharing torch's generator

// A model with weights of `seed`'s.
Net make_net(std::uint64_t seed) {
    std::lock_guard lock(torch_state);
    torch::manual_seed(seed);
    return Net();
}

void write(const std::filesystem::path& dir) {
    constexpr int steps = 3;
    torch::manual_seed(100);
    const auto xs = torch::randn({steps, 2, batch, inputs});
    const auto ys = torch::randint(0, classes, {steps, 2, batch}, torch::kLong);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        auto net = make_net(7 + static_cast<std::uint64_t>(backend.rank()));  // rank 0's at construction
        gradsync::DataParallel dp(net, backend);
        torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        for (int step = 0; step < steps; ++step) {
            const auto x = xs[step][backend.rank()], y = ys[step][backend.rank()];
            net->train();
            sgd.zero_grad();
            torch::nn::functional::cross_entropy(net->forward(x), y).backward();
            dp.step([&] { sgd.step(); });
        }
        gradsync::Checkpoint().save(dir / "gradsync.safetensors", dp);
        if (backend.rank() == 0) write_floats(dir / "gradsync_output.bin", output_of(net));
    });
}

int read(const std::filesystem::path& dir) {
    const auto expected = read_floats(dir / "python_output.bin");
    std::vector<std::vector<float>> got(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        auto net = make_net(1);  // other weights than Python's: the load must replace them all
        gradsync::DataParallel dp(net, backend);
        gradsync::Checkpoint().load_weights(dir / "python.safetensors", dp);
        got[static_cast<std::size_t>(backend.rank())] = output_of(net);
    });
    int status = 0;
    for (std::size_t r = 0; r < got.size(); ++r)
        for (std::size_t i = 0; i < expected.size(); ++i)
            if (!(std::fabs(got[r][i] - expected[i]) <= 1e-6f * (1.0f + std::fabs(expected[i])))) {
                std::fprintf(stderr, "rank %zu output %zu: %.9g here, %.9g in Python\n", r, i, got[r][i], expected[i]);
                status = 1;
            }
    if (status == 0) std::printf("the state dict Python wrote gives Python's outputs here, on both ranks\n");
    return status;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3 || (std::string(argv[1]) != "write" && std::string(argv[1]) != "read")) {
        std::fprintf(stderr, "usage: %s write|read DIR\n", argv[0]);
        return 2;
    }
    try {
        if (std::string(argv[1]) == "write") {
            write(argv[2]);
            std::printf("wrote %s/gradsync.safetensors\n", argv[2]);
            return 0;
        }
        return read(argv[2]);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 1;
    }
}
