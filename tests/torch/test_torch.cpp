// The libtorch adapter against Debian's libtorch: torch models (an MLP, one with BatchNorm) trained
// on N ranks equal one process on the whole batch, every rank bitwise identical after every step,
// with and without overlap hooks and with gradients torch frees and reallocates every step; every
// floating dtype; and the errors for what gradsync cannot read. One binary: in-process ranks
// (spawn) when started plainly, MpiBackend ranks when started by mpirun.
#include <torch/torch.h>

#include <gradsync/backend/mpi.hpp>
#include <gradsync/gradsync.hpp>
#include <gradsync/torch.hpp>

// libtorch's glog defines CHECK (which aborts); the tests mean doctest's.
#undef CHECK
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "../mpi/run_on_every_rank.hpp"
#include "../support/sharded_optimizers.hpp"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int steps = 6;
constexpr int micro_batch = 8;
constexpr int inputs = 12, hidden = 16, classes = 5;

struct NetImpl : torch::nn::Module {
    explicit NetImpl(bool batch_norm) {
        fc1 = register_module("fc1", torch::nn::Linear(inputs, hidden));
        if (batch_norm) bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
        fc2 = register_module("fc2", torch::nn::Linear(hidden, classes));
    }
    torch::Tensor forward(torch::Tensor x) {
        x = fc1(x);
        if (bn) x = bn(x);
        return fc2(torch::relu(x));
    }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
    torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

// How a run trains.
struct Setup {
    bool batch_norm = false;
    bool overlap = false;     // grad_ready from torch's backward hooks
    bool reallocate = false;  // gradients freed every step (zero_grad(true)) and made anew in backward
};

// The data of every step, made once on the main thread.
struct Data {
    torch::Tensor x, y;
    explicit Data(int world) {
        torch::manual_seed(2026);
        x = torch::randn({steps * world * micro_batch, inputs});
        y = torch::randint(classes, {steps * world * micro_batch}, torch::kLong);
    }
};

std::mutex torch_state;  // the ranks of spawn are threads of one process, sharing torch's generator

// A model with the same initial weights on every call (rank 0's), and on other ranks weights of
// their own, which rank 0's broadcast must replace.
Net make_net(bool batch_norm, int rank) {
    std::lock_guard lock(torch_state);
    torch::manual_seed(static_cast<std::uint64_t>(1 + rank));
    return Net(batch_norm);
}

std::uint64_t bits_hash(Net& net) {
    std::uint64_t h = 1469598103934665603ull;
    auto mix = [&](const torch::Tensor& t) {
        auto c = t.contiguous();
        const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
        for (std::size_t i = 0; i < static_cast<std::size_t>(c.nbytes()); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
    };
    for (auto& p : net->parameters()) mix(p);
    for (auto& b : net->buffers()) mix(b);
    return h;
}

std::vector<torch::Tensor> state_of(Net& net) {
    std::vector<torch::Tensor> out;
    for (auto& p : net->parameters()) out.push_back(p.detach().clone());
    for (auto& b : net->buffers()) out.push_back(b.detach().clone());
    return out;
}

// Zeroes the gradients, or frees them as zero_grad(true) does; with `old`, the old storage is
// kept alive, so that backward's new gradients cannot land at the same addresses.
void clear_gradients(Net& net, bool reallocate, std::vector<torch::Tensor>* old = nullptr) {
    for (auto& p : net->parameters()) {
        if (reallocate) {
            if (old != nullptr) old->push_back(p.grad());
            p.mutable_grad().reset();
        } else if (p.grad().defined()) {
            p.mutable_grad().zero_();
        }
    }
}

torch::optim::SGD make_optimizer(Net& net) {
    return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// One process on the whole batch of `world` micro-batches. With BatchNorm, whose statistics are
// each rank's own, the batch goes through as `world` micro-batches whose gradients add up, and the
// running statistics are those of micro-batch 0 (rank 0's, which every rank receives).
std::vector<torch::Tensor> train_single(const Data& data, int world, bool batch_norm) {
    auto net = make_net(batch_norm, 0);
    auto optimizer = make_optimizer(net);
    const int global = world * micro_batch;
    for (int s = 0; s < steps; ++s) {
        clear_gradients(net, false);
        if (!batch_norm) {
            auto x = data.x.narrow(0, s * global, global), y = data.y.narrow(0, s * global, global);
            torch::nn::functional::cross_entropy(net->forward(x), y).backward();
        } else {
            const auto start = net->buffers();
            std::vector<torch::Tensor> before, after;
            for (auto& b : start) before.push_back(b.detach().clone());
            for (int r = 0; r < world; ++r) {
                torch::NoGradGuard no_grad;
                for (std::size_t i = 0; i < start.size(); ++i) start[i].copy_(before[i]);
                torch::AutoGradMode grad_on(true);
                const auto offset = s * global + r * micro_batch;
                auto x = data.x.narrow(0, offset, micro_batch), y = data.y.narrow(0, offset, micro_batch);
                (torch::nn::functional::cross_entropy(net->forward(x), y) / world).backward();
                if (r == 0)
                    for (auto& b : start) after.push_back(b.detach().clone());
            }
            torch::NoGradGuard no_grad;
            for (std::size_t i = 0; i < start.size(); ++i) start[i].copy_(after[i]);
        }
        optimizer.step();
    }
    return state_of(net);
}

// One rank's training; returns its hash after every step.
template <class Backend>
std::vector<std::uint64_t> train_rank(Backend& backend, const Data& data, const Setup& setup,
                                      std::vector<torch::Tensor>* final_state) {
    const int rank = backend.rank(), world = backend.size();
    auto net = make_net(setup.batch_norm, rank);
    gradsync::DataParallel dp(net, backend);  // a holder, passed as it is
    std::optional<gradsync::libtorch::Overlap> hooks;
    if (setup.overlap) hooks = gradsync::libtorch::overlap(dp);
    auto optimizer = make_optimizer(net);
    std::vector<std::uint64_t> hashes;
    const auto trainable = net->parameters().size();
    for (int s = 0; s < steps; ++s) {
        std::vector<torch::Tensor> old;
        clear_gradients(net, setup.reallocate, &old);
        const auto offset = s * world * micro_batch + rank * micro_batch;
        auto x = data.x.narrow(0, offset, micro_batch), y = data.y.narrow(0, offset, micro_batch);
        torch::nn::functional::cross_entropy(net->forward(x), y).backward();
        if (setup.overlap) CHECK(hooks->reported() == (s + 1) * trainable);  // from torch's backward
        if (setup.reallocate)
            for (std::size_t i = 0; i < old.size(); ++i)
                CHECK(net->parameters()[i].grad().data_ptr() != old[i].data_ptr());  // moved
        dp.step([&] { optimizer.step(); });
        hashes.push_back(bits_hash(net));
    }
    if (final_state != nullptr) *final_state = state_of(net);
    return hashes;
}

double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        auto diff = (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>();
        auto scale = std::max(1.0, b[i].to(torch::kDouble).abs().max().item<double>());
        worst = std::max(worst, diff / scale);
    }
    return worst;
}

// N ranks on threads: rank 0's final state; checks every rank's hashes agree after every step.
std::vector<torch::Tensor> train_spawned(const Data& data, int world, const Setup& setup) {
    std::vector<std::vector<std::uint64_t>> hashes(static_cast<std::size_t>(world));
    std::vector<torch::Tensor> rank0;
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        hashes[r] = train_rank(backend, data, setup, r == 0 ? &rank0 : nullptr);
    });
    for (int r = 1; r < world; ++r) CHECK_MESSAGE(hashes[r] == hashes[0], "rank " << r << " differs from rank 0");
    return rank0;
}

bool under_mpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

}  // namespace

TEST_SUITE("in-process") {
    TEST_CASE("torch models on N ranks equal one process on the whole batch") {
        for (bool batch_norm : {false, true}) {
            for (bool reallocate : {false, true}) {
                for (int world = 1; world <= 4; ++world) {
                    CAPTURE(batch_norm);
                    CAPTURE(reallocate);
                    CAPTURE(world);
                    const Data data(world);
                    const auto single = train_single(data, world, batch_norm);
                    const auto plain = train_spawned(data, world, {batch_norm, false, reallocate});
                    const auto overlapped = train_spawned(data, world, {batch_norm, true, reallocate});
                    CHECK(max_relative_difference(plain, single) <= 1e-5);
                    // Training moved the weights, so that the equality above says something.
                    auto start = make_net(batch_norm, 0);
                    CHECK(max_relative_difference(state_of(start), single) > 1e-3);
                    // The hooks change when buckets go, not what they sum: the same bits.
                    CHECK(max_relative_difference(overlapped, plain) == 0.0);
                }
            }
        }
    }
}

TEST_SUITE("in-process") {
    TEST_CASE("every floating dtype of libtorch, with gradients made where torch has none") {
        struct Mixed : torch::nn::Module {
            explicit Mixed(int rank) {
                for (auto type : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16})
                    register_parameter(std::string(c10::toString(type)), torch::full({5}, rank + 1.0, type));
                register_parameter("frozen", torch::zeros({2}), /*requires_grad=*/false);
            }
        };
        const gradsync::DType expected[] = {gradsync::DType::float32, gradsync::DType::float64,
                                            gradsync::DType::float16, gradsync::DType::bfloat16};
        gradsync::spawn(3, [&](gradsync::LocalBackend& backend) {
            Mixed model(backend.rank());
            for (auto& p : model.parameters()) CHECK_FALSE(p.grad().defined());
            gradsync::DataParallel dp(model, backend);
            REQUIRE(dp.parameters().size() == 4);    // the frozen one is not synchronized
            const auto params = model.parameters();  // the trainable ones first, in order
            for (std::size_t i = 0; i < 4; ++i) {
                auto p = params[i];
                CHECK(dp.parameters()[i].dtype == expected[i]);
                CHECK(dp.parameters()[i].data == p.data_ptr());
                REQUIRE(p.grad().defined());  // made at construction
                CHECK(p.grad().eq(0).all().item<bool>());
                CHECK(p.eq(1.0).all().item<bool>());                 // rank 0's values
                p.mutable_grad().fill_(2.0 * (backend.rank() + 1));  // 2, 4, 6: exact in every dtype
            }
            dp.synchronize();
            for (std::size_t i = 0; i < 4; ++i) CHECK(params[i].grad().eq(4.0).all().item<bool>());
        });
    }

    TEST_CASE("a gradient torch freed is left for torch's backward to make, not made by gradsync") {
        Net net(/*batch_norm=*/false);
        for (auto& p : net->parameters()) CHECK_FALSE(p.grad().defined());
        for (auto& p : gradsync::model_traits<Net>::parameters_now(net)) CHECK(p.grad == nullptr);
        auto lister = gradsync::model_traits<Net>::lister_for_step(net);  // what a step's backward lists through
        for (auto& p : lister.parameters_now()) CHECK(p.grad == nullptr);
        for (auto& p : net->parameters()) CHECK_FALSE(p.grad().defined());   // still none
        for (auto& p : gradsync::parameters(net)) CHECK(p.grad != nullptr);  // made, zeros
        for (auto& p : net->parameters()) CHECK(p.grad().defined());
        // The lister reads gradients made after it was: the same list as a full listing.
        const auto listed = gradsync::parameters(net), relisted = lister.parameters_now();
        REQUIRE(relisted.size() == listed.size());
        for (std::size_t i = 0; i < listed.size(); ++i) {
            CHECK(relisted[i].name == listed[i].name);
            CHECK(relisted[i].data == listed[i].data);
            CHECK(relisted[i].grad == listed[i].grad);
            CHECK(relisted[i].count == listed[i].count);
        }

        // One bucket per tensor, so buckets go while backward runs. A tensor hook runs before torch
        // accumulates: no gradient may exist yet there, or torch sums into memory gradsync zeroed
        // instead of adopting the incoming gradient.
        std::vector<std::vector<std::uint64_t>> hashes(2);
        const Data data(2);
        gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
            auto model = make_net(false, backend.rank());
            gradsync::DataParallel dp(
                model, backend,
                gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{1}, .first_cap = gradsync::Bytes{1}});
            REQUIRE(dp.plan().buckets.size() == 4);
            auto hooks = gradsync::libtorch::overlap(dp);
            auto optimizer = make_optimizer(model);
            auto params = model->parameters();
            std::vector<int> existed(params.size(), 0);
            for (std::size_t i = 0; i < params.size(); ++i)
                params[i].register_hook(
                    [&existed, &params, i](const torch::Tensor&) { existed[i] += params[i].grad().defined() ? 1 : 0; });
            for (int s = 0; s < 3; ++s) {
                clear_gradients(model, /*reallocate=*/true);
                const auto offset = (s * 2 + backend.rank()) * micro_batch;
                auto x = data.x.narrow(0, offset, micro_batch), y = data.y.narrow(0, offset, micro_batch);
                torch::nn::functional::cross_entropy(model->forward(x), y).backward();
                for (std::size_t i = 0; i < params.size(); ++i) CHECK_MESSAGE(existed[i] == 0, "parameter " << i);
                dp.step([&] { optimizer.step(); });
                hashes[static_cast<std::size_t>(backend.rank())].push_back(bits_hash(model));
            }
        });
        CHECK(hashes[0] == hashes[1]);
    }

    TEST_CASE("sharded, releasing torch's gradients once reduced == keeping them, bitwise") {
        // One bucket per tensor, so buckets are reduced and released while backward runs.
        const gradsync::SizeCappedBuckets per_tensor{.cap = gradsync::Bytes{1}, .first_cap = gradsync::Bytes{1}};
        for (int world : {1, 2, 3}) {
            CAPTURE(world);
            const Data data(world);
            std::vector<std::vector<std::uint64_t>> hashes(2 * static_cast<std::size_t>(world));
            for (bool release : {false, true}) {
                gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
                    auto net = make_net(false, backend.rank());
                    gradsync::ShardedDataParallel sdp(net, backend, per_tensor,
                                                      gradsync::ShardedOptions{.release_gradients = release});
                    auto hooks = gradsync::libtorch::overlap(sdp);
                    sharded::ShardedSgd sgd;
                    sgd.velocity.assign(sdp.state_elements(), 0.0f);
                    auto& mine = hashes[static_cast<std::size_t>(world * int(release) + backend.rank())];
                    for (int s = 0; s < steps; ++s) {
                        clear_gradients(net, /*reallocate=*/false);  // nothing to clear once released
                        const auto offset = s * world * micro_batch + backend.rank() * micro_batch;
                        auto x = data.x.narrow(0, offset, micro_batch), y = data.y.narrow(0, offset, micro_batch);
                        torch::nn::functional::cross_entropy(net->forward(x), y).backward();
                        CHECK(sdp.step(sgd).applied);
                        for (auto& p : net->parameters()) CHECK(p.grad().defined() == !release);
                        mine.push_back(bits_hash(net));
                    }
                });
            }
            for (std::size_t r = 1; r < hashes.size(); ++r) CHECK(hashes[r] == hashes[0]);
        }
    }

    TEST_CASE("overlap hooks that outlive their wrapper call nothing; a new wrapper's hooks work beside them") {
        const Data data(1);
        gradsync::spawn(1, [&](gradsync::LocalBackend& backend) {
            auto net = make_net(false, 0);
            const auto trainable = net->parameters().size();
            auto backward = [&](int s) {
                clear_gradients(net, /*reallocate=*/false);
                auto x = data.x.narrow(0, s * micro_batch, micro_batch),
                     y = data.y.narrow(0, s * micro_batch, micro_batch);
                torch::nn::functional::cross_entropy(net->forward(x), y).backward();
            };
            std::optional<gradsync::libtorch::Overlap> old_hooks;
            {
                gradsync::DataParallel dp(net, backend);
                old_hooks = gradsync::libtorch::overlap(dp);
                backward(0);
                CHECK(old_hooks->reported() == trainable);
                dp.synchronize();
            }
            backward(1);  // the wrapper is gone: plain torch
            CHECK(old_hooks->reported() == trainable);
            for (auto& p : net->parameters()) CHECK(p.grad().defined());
            gradsync::ShardedDataParallel sdp(net, backend);
            auto hooks = gradsync::libtorch::overlap(sdp);
            backward(2);
            CHECK(hooks.reported() == trainable);
            CHECK(sdp.buckets_launched() == sdp.plan().buckets.size());
            CHECK(old_hooks->reported() == trainable);
            sharded::ShardedSgd sgd;
            sgd.velocity.assign(sdp.state_elements(), 0.0f);
            CHECK(sdp.step(sgd).applied);
        });
    }

    TEST_CASE("a submodule replaced on one rank is refused at its next step on every rank, not trained on") {
        const Data data(2);
        std::vector<std::string> errors(2);
        std::vector<std::uint64_t> steps_done(2);
        gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
            auto net = make_net(false, backend.rank());
            gradsync::DataParallel dp(net, backend);
            auto optimizer = make_optimizer(net);
            try {
                for (int s = 0; s < 3; ++s) {
                    if (s == 2 && backend.rank() == 1) {
                        std::lock_guard lock(torch_state);
                        net->fc1 = net->replace_module("fc1", torch::nn::Linear(inputs, hidden));  // fresh weights
                    }
                    clear_gradients(net, /*reallocate=*/false);
                    const auto offset = (s * 2 + backend.rank()) * micro_batch;
                    auto x = data.x.narrow(0, offset, micro_batch), y = data.y.narrow(0, offset, micro_batch);
                    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
                    dp.step([&] { optimizer.step(); });
                }
            } catch (const gradsync::Error& e) {
                errors[static_cast<std::size_t>(backend.rank())] = e.what();
            }
            steps_done[static_cast<std::size_t>(backend.rank())] = dp.steps();
        });
        CHECK_MESSAGE(errors[1].find("rank 1, step 3: the values of parameter 'fc1.") != std::string::npos, errors[1]);
        CHECK(errors[0].find("rank 1") != std::string::npos);
        CHECK(steps_done[1] == 2);
        CHECK(steps_done[0] <= 2);
    }

    TEST_CASE("a module, its holder and a shared_ptr to it list the same parameters and buffers") {
        gradsync::spawn(1, [&](gradsync::LocalBackend& backend) {
            Net holder(/*batch_norm=*/true);
            auto pointer = holder.ptr();
            gradsync::DataParallel by_holder(holder, backend);
            gradsync::DataParallel by_pointer(pointer, backend);
            gradsync::DataParallel by_module(*holder, backend);
            std::vector<std::string> names;
            for (auto& p : by_holder.parameters()) names.push_back(p.name);
            CHECK(names ==
                  std::vector<std::string>{"fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.weight", "fc2.bias"});
            for (auto dp_params : {by_pointer.parameters(), by_module.parameters()}) {
                REQUIRE(dp_params.size() == names.size());
                for (std::size_t i = 0; i < names.size(); ++i) CHECK(dp_params[i].name == names[i]);
            }
            std::vector<std::string> buffers;
            for (auto& b : by_holder.buffers()) buffers.push_back(b.name + ":" + gradsync::to_string(b.dtype));
            CHECK(buffers == std::vector<std::string>{"bn.running_mean:float32", "bn.running_var:float32",
                                                      "bn.num_batches_tracked:int64"});
        });
    }

    TEST_CASE("what gradsync cannot read is refused, naming the tensor") {
        struct Transposed : torch::nn::Module {
            Transposed() { register_parameter("w", torch::randn({4, 3}).t().detach()); }
        };
        struct Masked : torch::nn::Module {
            Masked() {
                register_parameter("w", torch::randn({3}));
                register_buffer("mask", torch::ones({3}, torch::kBool));
            }
        };
        gradsync::spawn(1, [&](gradsync::LocalBackend& backend) {
            Transposed transposed;
            CHECK_THROWS_WITH_AS(gradsync::DataParallel(transposed, backend),
                                 doctest::Contains("parameter 'w' is not a dense contiguous tensor"),
                                 gradsync::InvalidModel);
            Masked masked;
            CHECK_THROWS_WITH_AS(gradsync::DataParallel(masked, backend),
                                 doctest::Contains("buffer 'mask' is Bool on cpu"), gradsync::InvalidModel);
            gradsync::DataParallel ignoring(masked, backend, gradsync::IgnoreBuffers{});  // the way out it names
            CHECK(ignoring.buffers().empty());
        });
    }
}

TEST_SUITE("mpi") {
    TEST_CASE("torch models on MPI ranks equal one process on the whole batch") {
        gradsync::MpiBackend backend;
        const int world = backend.size();
        const Data data(world);
        for (int config = 0; config < 8; ++config) {
            const Setup setup{(config & 4) != 0, (config & 2) != 0, (config & 1) != 0};
            const bool batch_norm = setup.batch_norm;
            CAPTURE(batch_norm);
            CAPTURE(setup.overlap);
            CAPTURE(setup.reallocate);
            {
                std::vector<torch::Tensor> state;
                const auto hashes = train_rank(backend, data, setup, &state);
                CHECK(max_relative_difference(state, train_single(data, world, batch_norm)) <= 1e-5);
                // every rank's hash equals rank 0's after every step
                std::vector<std::uint64_t> rank0 = hashes;
                backend.broadcast(std::span(reinterpret_cast<std::byte*>(rank0.data()), rank0.size() * 8), 0);
                CHECK(hashes == rank0);
            }
        }
    }
}

int main(int argc, char** argv) {
    torch::set_num_threads(1);  // ranks are threads or processes on few cores; no oversubscription
    doctest::Context context(argc, argv);
    context.setOption("no-colors", true);
    if (!under_mpi()) {
        context.addFilter("test-suite-exclude", "mpi");
        return context.run();
    }
    context.addFilter("test-suite", "mpi");
    return gradsync_test::run_on_every_rank(context, argc, argv);
}
