// What the libtorch adapter costs per step: synchronize() on 2 ranks (threads) of a torch module
// whose parameters have ResNet-50's layout, against the same layout in plain std::vector<float>
// buffers, in the same run and alternating, so that both see the same machine. The adapter lists
// the module again every step (named_parameters(), to follow gradients torch may reallocate);
// the plain model is listed too (Options::storage_may_move is on for both).
//
//   bench_torch [--quick]   (--quick: one round of one step, only to check every figure is produced)
#include <torch/torch.h>

#include <gradsync/gradsync.hpp>
#include <gradsync/torch.hpp>

#include "layout_model.hpp"
#include "model_layouts.hpp"
#include "stats.hpp"
#include "summary_rows.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

// A module with one parameter per tensor of the layout (torch names cannot hold '.').
struct LayoutModule : torch::nn::Module {
    explicit LayoutModule(const std::vector<layouts::Tensor>& tensors) {
        for (const auto& t : tensors) {
            std::string name = t.name;
            std::replace(name.begin(), name.end(), '.', '_');
            auto p = register_parameter(name, torch::full({static_cast<std::int64_t>(t.count)}, 0.5f));
            p.mutable_grad() = torch::ones_like(p);
        }
    }
};

template <class Model>
void time_steps(gradsync::DataParallel<Model, gradsync::LocalBackend>& dp, int steps_per_round,
                std::vector<double>& samples) {
    for (int s = 0; s < steps_per_round; ++s) {
        const auto start = std::chrono::steady_clock::now();
        dp.synchronize();
        samples.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
}

}  // namespace

int main(int argc, char** argv) {
    const bool quick = argc == 2 && std::string(argv[1]) == "--quick";
    if (argc > 2 || (argc == 2 && !quick)) {
        std::fprintf(stderr, "usage: bench_torch [--quick]\n");
        return 2;
    }
    const int rounds = quick ? 1 : 5, steps_per_round = quick ? 1 : 6;
    torch::set_num_threads(1);
    const auto tensors = layouts::resnet50();
    std::vector<double> torch_ms, plain_ms, listing_us;
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        LayoutModule module(tensors);
        bench::LayoutModel plain(tensors);
        gradsync::DataParallel torch_dp(module, backend);
        gradsync::DataParallel plain_dp(plain, backend);
        std::vector<double> mine_torch, mine_plain, mine_listing;
        for (int r = 0; r < rounds; ++r) {
            time_steps(torch_dp, steps_per_round, mine_torch);
            time_steps(plain_dp, steps_per_round, mine_plain);
            const auto start = std::chrono::steady_clock::now();
            const auto listed = gradsync::parameters(module);
            mine_listing.push_back(
                std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
            if (listed.size() != tensors.size()) std::abort();
        }
        if (backend.rank() == 0) {
            torch_ms = mine_torch;
            plain_ms = mine_plain;
            listing_us = mine_listing;
        }
    });
    const double t = bench::median(torch_ms), p = bench::median(plain_ms);
    std::printf("libtorch adapter, ResNet-50 layout (%zu tensors), 2 ranks, synchronize() median of %d steps:\n",
                tensors.size(), rounds * steps_per_round);
    std::printf("  torch module   %8.2f ms\n  plain vectors  %8.2f ms   (the ceiling: same layout, no adapter)\n", t,
                p);
    std::printf("  ratio          %8.3f   (1.0 = the adapter costs nothing)\n", t / p);
    std::printf("  listing the module once: %.0f us (median)\n", bench::median(listing_us));
    // A figure that is not a finite positive number means the benchmark broke.
    if (!bench::sane(t) || !bench::sane(p)) {
        std::printf("BROKEN: the adapter's or the plain model's time is not a finite positive figure\n");
        return 1;
    }
    bench::write_summary_rows("torch_adapter", {{"libtorch adapter synchronize(), ResNet-50 / plain vectors", t, "ms",
                                                 "plain vectors", p, "", t / p, "-", true}});
}
