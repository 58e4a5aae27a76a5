// What the libtorch adapter costs per step: synchronize() on 2 ranks (threads) of a torch module
// whose parameters have ResNet-50's layout, against the same layout in plain std::vector<float>
// buffers, in the same run and alternating, so that both see the same machine. The adapter lists
// the module again every step (named_parameters(), to follow gradients torch may reallocate);
// the plain model is listed too (Options::storage_may_move is on for both). Beside it, what a bucket
// launched in backward pays to list the module again, from what the step kept.
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
    std::vector<double> torch_ms, plain_ms, listing_us, relisting_us;
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        LayoutModule module(tensors);
        bench::LayoutModel plain(tensors);
        gradsync::DataParallel torch_dp(module, backend);
        gradsync::DataParallel plain_dp(plain, backend);
        std::vector<double> mine_torch, mine_plain, mine_listing, mine_relisting;
        auto microseconds = [](auto&& list) {
            const auto start = std::chrono::steady_clock::now();
            const auto listed = list();
            const double us =
                std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
            if (listed.size() != layouts::resnet50().size()) std::abort();
            return us;
        };
        for (int r = 0; r < rounds; ++r) {
            time_steps(torch_dp, steps_per_round, mine_torch);
            time_steps(plain_dp, steps_per_round, mine_plain);
            mine_listing.push_back(microseconds([&] { return gradsync::parameters(module); }));
            // In backward, every bucket after the first lists through what the step kept.
            auto lister = gradsync::model_traits<LayoutModule>::lister_for_step(module);
            mine_relisting.push_back(microseconds([&] { return lister.parameters_now(); }));
        }
        if (backend.rank() == 0) {
            torch_ms = mine_torch;
            plain_ms = mine_plain;
            listing_us = mine_listing;
            relisting_us = mine_relisting;
        }
    });
    const double t = bench::median(torch_ms), p = bench::median(plain_ms);
    std::printf("libtorch adapter, ResNet-50 layout (%zu tensors), 2 ranks, synchronize() median of %d steps:\n",
                tensors.size(), rounds * steps_per_round);
    std::printf("  torch module   %8.2f ms\n  plain vectors  %8.2f ms   (the ceiling: same layout, no adapter)\n", t,
                p);
    std::printf("  ratio          %8.3f   (1.0 = the adapter costs nothing)\n", t / p);
    const double list = bench::median(listing_us), relist = bench::median(relisting_us);
    std::printf("  listing the module once: %.0f us (median)\n", list);
    std::printf("  listing it again in backward, from what the step kept: %.1f us (median; %.3f of a listing)\n",
                relist, relist / list);
    // A figure that is not a finite positive number means the benchmark broke.
    if (!bench::sane(t) || !bench::sane(p) || !bench::sane(list) || !bench::sane(relist)) {
        std::printf("BROKEN: a time (adapter, plain model, listings) is not a finite positive figure\n");
        return 1;
    }
    bench::write_summary_rows(
        "torch_adapter", {{"libtorch adapter synchronize(), ResNet-50 / plain vectors", t, "ms", "plain vectors", p, "",
                           t / p, "-", true},
                          {"libtorch listing per bucket in backward, kept for the step / a full listing", relist, "us",
                           "full listing", list, "", relist / list, "-", true}});
}
