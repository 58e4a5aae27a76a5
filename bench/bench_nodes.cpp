// Between machines, played on one by scripts/nodes.py with every node's link slowed (tc tbf):
// DataParallel::synchronize() on the ResNet-50 and BERT-base gradient layouts, over
//   - TwoLevelBackend (reduce-scatter in the node, allreduce across, all-gather in the node)
//     beside the flat MpiBackend over the whole job, its ranks numbered node by node (as mpirun
//     places them: its ring crosses each node's link once each way) and numbered round-robin
//     across the nodes (as a cyclic placement does: every step of its ring crosses a link);
//   - TwoLevelBackend whose node level is a SharedMemoryBackend beside the one over MpiBackend;
//   - bfloat16 wire compression, and PowerSGD at rank 4, beside float32, both on the flat backend;
//   - ShardedDataParallel::step() over TwoLevelBackend (hybrid sharding: the state split in the
//     node, replicated across) beside the same step sharded over the flat backend.
// Each with the bytes its node sent on its link per synchronize() (the node's own eth0 counter),
// and the two levels beside what a model of the link predicts. Figures are medians of
// alternating iterations; an iteration's time is the slowest rank's.
//
//   nodes.py run --nodes 2 --per-node 2 --rate 1gbit -- bench_nodes [--iterations N] [--scale F]
//                                                                   [--chunk-kib K]
//
// --scale keeps that fraction of every tensor (default 0.25: a quarter of each network, so that
// the run at 1 Gbit/s takes about two minutes; the ratios do not depend on it while the link
// dominates).
#include <gradsync/backend/mpi.hpp>
#include <gradsync/gradsync.hpp>

#include "layout_model.hpp"
#include "model_layouts.hpp"
#include "mpi_step_pairs.hpp"  // for timed, alternate
#include "stats.hpp"
#include "summary_rows.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace {

struct Settings {
    int iterations = 5;
    double scale = 0.25;
    gradsync::MpiOptions mpi;  // of every backend: the flat ones and both levels
};

// Bytes this node has sent on its link so far (inside the node's network namespace, eth0 is it).
double link_bytes_sent() {
    std::ifstream in("/sys/class/net/eth0/statistics/tx_bytes");
    double bytes = 0;
    in >> bytes;
    return bytes;
}

// `f`, counting what the node sent meanwhile into `bytes` (the most any rank of it saw).
std::function<void()> counted(std::function<void()> f, std::vector<double>& bytes) {
    return [f = std::move(f), &bytes] {
        const double before = link_bytes_sent();
        f();
        double sent = link_bytes_sent() - before, most = 0;
        MPI_Allreduce(&sent, &most, 1, MPI_DOUBLE, MPI_MAX, gradsync::mpi_world());
        bytes.push_back(most);
    };
}

std::vector<layouts::Tensor> scaled(std::vector<layouts::Tensor> tensors, double scale) {
    // The first dimension scaled, the others kept: matrices stay matrices (PowerSGD compresses them).
    for (auto& t : tensors) {
        if (t.shape.empty()) t.shape = {t.count};
        t.shape[0] = std::max<std::size_t>(1, static_cast<std::size_t>(double(t.shape[0]) * scale));
        t.count = 1;
        for (const auto d : t.shape) t.count *= d;
    }
    return tensors;
}

// MPI_Allreduce in place over every gradient tensor of a model, one call each: what the flat
// backend's DataParallel is measured against.
struct RawPerTensor {
    bench::LayoutModel& model;
    void synchronize() {
        for (auto& g : model.gradients())
            MPI_Allreduce(MPI_IN_PLACE, g.data(), static_cast<int>(g.size()), MPI_FLOAT, MPI_SUM,
                          gradsync::mpi_world());
    }
};

// A ShardedDataParallel step with plain SGD on its pieces, as race() calls it.
template <class Sharded>
struct ShardedStep {
    Sharded& sdp;
    void synchronize() {
        (void)sdp.step([](std::span<const gradsync::ShardPiece<float>> pieces) {
            for (const auto& p : pieces)
                for (std::size_t i = 0; i < p.params.size(); ++i) p.params[i] -= 1e-6f * p.grads[i];
        });
    }
};

struct Pair {
    std::string what;
    double ms = 0, base_ms = 0, ratio = 0;
    double mb = 0, base_mb = 0;  // the node's link, per synchronize()
};

// a against b, each a DataParallel over `tensors`: time and the node's bytes on its link.
template <class A, class B>
Pair race(const std::string& what, A& a, B& b, const Settings& s) {
    std::vector<double> a_bytes, b_bytes;
    const auto t =
        alternate(counted([&] { a.synchronize(); }, a_bytes), counted([&] { b.synchronize(); }, b_bytes), s.iterations);
    // alternate() drops its two warm-up rounds from the times; the bytes drop them here.
    a_bytes.erase(a_bytes.begin(), a_bytes.begin() + 2);
    b_bytes.erase(b_bytes.begin(), b_bytes.begin() + 2);
    return {what,
            bench::median(t.a) * 1e3,
            bench::median(t.b) * 1e3,
            bench::median(t.ratios),
            bench::median(a_bytes) / 1e6,
            bench::median(b_bytes) / 1e6};
}

void print(const Pair& p, const char* a, const char* b, int rank) {
    if (rank != 0) return;
    std::printf("  %-34s %-10s %9.1f ms, link %8.2f MB | %-8s %9.1f ms, link %8.2f MB | time ratio %.3f\n",
                p.what.c_str(), a, p.ms, p.mb, b, p.base_ms, p.base_mb, p.ratio);
    std::fflush(stdout);
}

gradsync::MpiOptions named(gradsync::MpiOptions options, std::string name) {
    options.group_name = std::move(name);
    return options;
}

int env_int(const char* name) {
    const char* v = std::getenv(name);
    return v ? std::atoi(v) : 0;
}

}  // namespace

int main(int argc, char** argv) {
    gradsync::MpiSession mpi(argc, argv);
    Settings s;
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--iterations") && i + 1 < argc) s.iterations = std::atoi(argv[++i]);
        if (!std::strcmp(argv[i], "--scale") && i + 1 < argc) s.scale = std::atof(argv[++i]);
        if (!std::strcmp(argv[i], "--chunk-kib") && i + 1 < argc)
            s.mpi.chunk = gradsync::Bytes{std::strtoull(argv[++i], nullptr, 10) << 10};
    }
    const int nodes = env_int("GRADSYNC_TEST_NODES"), per_node = env_int("GRADSYNC_TEST_RANKS_PER_NODE");
    if (nodes < 2 || per_node < 1) {
        std::fprintf(stderr, "bench_nodes: run it under scripts/nodes.py (several nodes, their links slowed)\n");
        return 2;
    }
    gradsync::MpiBackend flat(gradsync::mpi_world(), s.mpi);
    // The same ranks numbered round-robin across the nodes: node-local rank first.
    const int me = flat.rank();
    gradsync::MpiBackend cyclic(gradsync::mpi_split(gradsync::mpi_world(), 0, (me % per_node) * nodes + me / per_node),
                                named(s.mpi, "round-robin"));
    auto node_comm = gradsync::mpi_node_comm();
    auto across_comm = gradsync::mpi_cross_node_comm(gradsync::mpi_world(), node_comm);
    gradsync::MpiBackend node(node_comm, named(s.mpi, "node")), across(across_comm, named(s.mpi, "across"));
    gradsync::TwoLevelBackend two_level(node, across);
    auto shared_node = gradsync::shared_memory_group(node_comm);
    gradsync::MpiBackend shared_across(across_comm, named(s.mpi, "across, beside shared memory"));
    gradsync::TwoLevelBackend two_level_shared(*shared_node, shared_across);
    const int rank = me, n = flat.size();
    const double m = nodes;
    // A flat ring numbered node by node crosses each node's link once each way, carrying
    // 2 (n - 1) / n of the gradients; two levels carry 2 (m - 1) / m of them across.
    const double predicted = (2 * (m - 1) / m) / (2.0 * (n - 1) / n);
    // Round-robin, every edge of the ring crosses: each node sends per_node times as much.
    const double predicted_cyclic = predicted / per_node;
    const char* rate = std::getenv("GRADSYNC_TEST_LINK_RATE");
    if (rank == 0)
        std::printf(
            "%d nodes x %d ranks, links at %s, tensors scaled by %g, MpiOptions::chunk %s, %d iterations; "
            "two levels / flat on the link: %.3f predicted\n",
            nodes, per_node, rate ? rate : "full speed", s.scale, gradsync::to_string(s.mpi.chunk).c_str(),
            s.iterations, predicted);

    std::vector<bench::SummaryRow> rows;
    for (const auto& [name, tensors] : {std::pair{std::string("ResNet-50"), layouts::resnet50()},
                                        std::pair{std::string("BERT-base"), layouts::bert_base()}}) {
        const auto layout = scaled(tensors, s.scale);
        bench::LayoutModel a(layout), b(layout), c(layout), d(layout), e(layout);
        gradsync::DataParallel over_two(a, two_level);
        gradsync::DataParallel over_flat(b, flat), over_cyclic(e, cyclic);
        // The flat backend's ceiling: Open MPI's own allreduce of the same gradients, tensor by tensor.
        RawPerTensor raw{b};
        const auto ceiling = race(name + ": flat / raw MPI per tensor", over_flat, raw, s);
        print(ceiling, "flat", "raw MPI", rank);
        const auto levels = race(name + ": two levels / flat", over_two, over_flat, s);
        print(levels, "two-level", "flat", rank);
        const auto round_robin = race(name + ": two levels / flat round-robin", over_two, over_cyclic, s);
        print(round_robin, "two-level", "flat r-r", rank);
        bench::LayoutModel h(layout);
        gradsync::DataParallel over_shared(h, two_level_shared);
        const auto node_level = race(name + ": node over shared memory / over MPI", over_shared, over_two, s);
        print(node_level, "shm node", "MPI node", rank);
        gradsync::DataParallel bf16(c, flat, gradsync::Bf16Compression{});
        const auto wire = race(name + ": bfloat16 wire / float32", bf16, over_flat, s);
        print(wire, "bfloat16", "float32", rank);
        gradsync::DataParallel powersgd(d, flat, gradsync::PowerSGD({.rank = 4}));
        const auto low_rank = race(name + ": PowerSGD rank 4 / float32", powersgd, over_flat, s);
        print(low_rank, "PowerSGD", "float32", rank);
        bench::LayoutModel f(layout), g(layout);
        gradsync::ShardedDataParallel hybrid_sdp(f, two_level);
        gradsync::ShardedDataParallel flat_sdp(g, flat);
        ShardedStep<decltype(hybrid_sdp)> hybrid_step{hybrid_sdp};
        ShardedStep<decltype(flat_sdp)> flat_step{flat_sdp};
        const auto hybrid = race(name + ": hybrid sharded / flat sharded", hybrid_step, flat_step, s);
        print(hybrid, "hybrid", "sharded", rank);
        if (rank == 0)
            std::printf(
                "  %-34s link bytes two levels / flat %.3f (predicted %.3f), / flat round-robin %.3f "
                "(predicted %.3f)\n",
                "", levels.mb / levels.base_mb, predicted, round_robin.mb / round_robin.base_mb, predicted_cyclic);
        rows.push_back({name + " flat / raw MPI_Allreduce per tensor, synchronize", ceiling.ms, "ms",
                        "raw MPI_Allreduce per tensor", ceiling.base_ms, "", ceiling.ratio, "-", true});
        rows.push_back({name + " two levels / flat, synchronize", levels.ms, "ms", "flat MpiBackend", levels.base_ms,
                        "", levels.ratio, "<= 0.6", levels.ratio <= 0.6});
        rows.push_back({name + " two levels / flat, bytes on a node's link", levels.mb, "MB", "flat MpiBackend",
                        levels.base_mb, "", levels.mb / levels.base_mb, "-", true});
        rows.push_back({name + " two levels / flat round-robin, synchronize", round_robin.ms, "ms",
                        "flat MpiBackend, ranks round-robin", round_robin.base_ms, "", round_robin.ratio, "<= 0.6",
                        round_robin.ratio <= 0.6});
        rows.push_back({name + " two levels / flat round-robin, bytes on a node's link", round_robin.mb, "MB",
                        "flat MpiBackend, ranks round-robin", round_robin.base_mb, "",
                        round_robin.mb / round_robin.base_mb, "-", true});
        rows.push_back({name + " two levels, node over shared memory / over MpiBackend, synchronize", node_level.ms,
                        "ms", "two levels, node over MpiBackend", node_level.base_ms, "", node_level.ratio, "-", true});
        rows.push_back({name + " hybrid sharded / sharded over the flat backend, step", hybrid.ms, "ms",
                        "ShardedDataParallel over flat MpiBackend", hybrid.base_ms, "", hybrid.ratio, "-", true});
        rows.push_back({name + " hybrid sharded / flat sharded, bytes on a node's link", hybrid.mb, "MB",
                        "ShardedDataParallel over flat MpiBackend", hybrid.base_mb, "", hybrid.mb / hybrid.base_mb, "-",
                        true});
        rows.push_back({name + " bf16 wire / float32, synchronize", wire.ms, "ms", "float32 wire", wire.base_ms, "",
                        wire.ratio, "<= 0.625", wire.ratio <= 0.625});
        rows.push_back({name + " PowerSGD rank 4 / float32, synchronize", low_rank.ms, "ms", "float32 wire",
                        low_rank.base_ms, "", low_rank.ratio, "-", true});
    }
    if (rank == 0)
        bench::write_summary_rows("nodes", rows,
                                  {{"nodes", nodes}, {"ranks_per_node", per_node}, {"link", rate ? rate : ""}});
    return 0;
}
