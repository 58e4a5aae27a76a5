// DataParallel<Model, MpiBackend>::synchronize() across processes, on the gradient layouts of
// ResNet-50 and BERT-base, against the transport's ceiling: raw in-place MPI_Allreduce (sum) of
// the model's own gradients, tensor by tensor in pieces of MpiOptions::chunk. Beside it, for
// reference, one raw MPI_Allreduce of a separate flat buffer of the same bytes (Open MPI's
// temporaries for one huge call page-fault on every call). Run under mpirun (scripts/bench.sh does, with
// 2 processes). Within every iteration they alternate, in alternating order; an iteration's time
// is the slowest rank's, and each figure is a median, beside the median of per-iteration ratios
// and the fastest and slowest iteration. First, unless --in-place-only or --busy, allreduce
// bandwidth by message size: raw MPI_Allreduce beside MpiBackend's. --busy runs it all beside one
// busy-looping thread per core, shared out among the processes. Unless --in-place-only or --busy,
// ShardedDataParallel::step and DataParallel::step with PowerSGD beside DataParallel::step on each
// layout (mpi_step_pairs.hpp).
//
//   bench_mpi [--iterations N] [--chunk-kib K] [--pack-kib K] [--algorithm auto|ring|mpi]
//             [--layout resnet50|bert_base] [--in-place-only] [--busy]
//             [--results-name NAME]   (the results file's name, where GRADSYNC_BENCH_RESULTS is set)
#include <gradsync/backend/mpi.hpp>
#include <gradsync/backend/shared_memory.hpp>
#include <gradsync/gradsync.hpp>

#include "layout_model.hpp"
#include "model_layouts.hpp"
#include "stats.hpp"
#include "busy_neighbours.hpp"
#include "mpi_step_pairs.hpp"
#include "summary_rows.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>  // for std::thread::hardware_concurrency
#include <vector>

namespace {

struct Settings {
    int iterations = 15;
    gradsync::MpiOptions mpi;
    std::string only;  // one layout, or both
    bool in_place_only = false;
    bool busy = false;            // one busy-looping thread per core beside the ranks (spread over the processes)
    std::string results = "mpi";  // the name of its results file (summary_rows.hpp)
};

struct Row {
    std::string name;
    double ms = 0;
    double ratio = 0;         // to the flat allreduce of the same iterations
    double ratio_pieces = 0;  // to the flat allreduce in pieces
    double raw_ms = 0, pieces_ms = 0;
    double fastest_ms = 0, slowest_ms = 0;  // of synchronize(): the spread of the iterations
    double shared_ms = 0;                   // the same over SharedMemoryBackend (in-place rows only; 0 where not run)
    double copy_ms = 0;                     // its ceiling: every process copying its gradients once, all at once
};

// A SharedMemoryBackend over this machine's processes.
std::unique_ptr<gradsync::SharedMemoryBackend> node_backend() {
    return gradsync::shared_memory_group(gradsync::mpi_node_comm());
}

template <class... Policies>
Row measure(const std::string& name, const std::vector<layouts::Tensor>& tensors, const Settings& s,
            Policies... policies) {
    gradsync::MpiBackend backend(gradsync::mpi_world(), s.mpi);
    bench::LayoutModel model(tensors);
    gradsync::DataParallel dp(model, backend, policies...);
    std::vector<float> flat(layouts::total_count(tensors), 1.0f);
    auto raw = [&] {
        MPI_Allreduce(MPI_IN_PLACE, flat.data(), static_cast<int>(flat.size()), MPI_FLOAT, MPI_SUM,
                      gradsync::mpi_world());
    };
    // The ceiling reduces the model's own gradients, tensor by tensor in pieces of the chunk: which
    // buffer a process reduces moves its speed by up to a third on a VM (where its pages lie),
    // so only the same memory compares.
    const std::size_t piece = s.mpi.chunk.count() / sizeof(float);
    auto pieces = [&] {
        for (auto& g : model.gradients())
            for (std::size_t off = 0; off < g.size(); off += piece)
                MPI_Allreduce(MPI_IN_PLACE, g.data() + off, static_cast<int>(std::min(piece, g.size() - off)),
                              MPI_FLOAT, MPI_SUM, gradsync::mpi_world());
    };
    auto sync = [&] { dp.synchronize(); };
    // The in-place row races the same synchronize() over shared memory, on a model of its own.
    constexpr bool in_place = sizeof...(Policies) == 0;
    std::unique_ptr<gradsync::SharedMemoryBackend> shared_backend;
    std::optional<bench::LayoutModel> shared_model;
    std::optional<gradsync::DataParallel<bench::LayoutModel, gradsync::SharedMemoryBackend>> shared_dp;
    if (in_place) {
        shared_backend = node_backend();
        shared_model.emplace(tensors);
        shared_dp.emplace(*shared_model, *shared_backend);
    }
    auto shared_sync = [&] { shared_dp->synchronize(); };
    // Any transport that cannot read a peer's memory copies each gradient out and the result back
    // in: one read and one write of every byte, as one memcpy of them does.
    std::vector<float> copied(in_place ? flat.size() : 0);
    auto copy_out = [&] {
        float* out = copied.data();
        for (auto& g : shared_model->gradients()) out = std::copy(g.begin(), g.end(), out);
    };
    std::vector<double> raw_s, pieces_s, sync_s, ratios, ratios_pieces, shared_s, copy_s;
    for (int i = -2; i < s.iterations; ++i) {  // two rounds of warm-up
        const bool raw_first = i % 2 == 0;
        double r = 0, p = 0, y = 0;
        if (raw_first) {
            r = timed(gradsync::mpi_world(), raw);
            p = timed(gradsync::mpi_world(), pieces);
        }
        y = timed(gradsync::mpi_world(), sync);
        if (!raw_first) {
            p = timed(gradsync::mpi_world(), pieces);
            r = timed(gradsync::mpi_world(), raw);
        }
        const double h = in_place ? timed(gradsync::mpi_world(), shared_sync) : 0.0;
        const double c = in_place ? timed(gradsync::mpi_world(), copy_out) : 0.0;
        if (i < 0) continue;
        shared_s.push_back(h);
        copy_s.push_back(c);
        raw_s.push_back(r);
        pieces_s.push_back(p);
        sync_s.push_back(y);
        ratios.push_back(y / r);
        ratios_pieces.push_back(y / p);
    }
    Row row{name,
            bench::median(sync_s) * 1e3,
            bench::median(ratios),
            bench::median(ratios_pieces),
            bench::median(raw_s) * 1e3,
            bench::median(pieces_s) * 1e3,
            *std::min_element(sync_s.begin(), sync_s.end()) * 1e3,
            *std::max_element(sync_s.begin(), sync_s.end()) * 1e3,
            bench::median(shared_s) * 1e3,
            bench::median(copy_s) * 1e3};
    if (backend.rank() == 0) {
        std::printf(
            "  %-22s synchronize %8.2f ms (%.2f - %.2f) | raw flat %8.2f ms, ratio %.3f | raw per tensor %8.2f ms, "
            "ratio %.3f",
            name.c_str(), row.ms, row.fastest_ms, row.slowest_ms, row.raw_ms, row.ratio, row.pieces_ms,
            row.ratio_pieces);
        if (in_place)
            std::printf(" | SharedMemoryBackend synchronize %8.2f ms | memcpy of the gradients %8.2f ms", row.shared_ms,
                        row.copy_ms);
        std::printf("\n");
        std::fflush(stdout);
    }
    return row;
}

// Allreduce bandwidth from 4 KiB to 256 MiB across the processes: raw in-place MPI_Allreduce (sum)
// beside MpiBackend::allreduce (average) of the same buffer, alternating; median seconds per call.
// Beside them the sharded pair, reduce_scatter then all_gather: MpiBackend's, and raw in-place
// MPI_Reduce_scatter_block + MPI_Allgather.
struct SweepPoint {
    std::size_t bytes = 0;
    double raw_s = 0, ours_s = 0, raw_sharded_s = 0, sharded_s = 0;
};

std::vector<SweepPoint> bandwidth_sweep(const Settings& s) {
    gradsync::MpiBackend backend(gradsync::mpi_world(), s.mpi);
    std::vector<SweepPoint> points;
    for (std::size_t bytes = 4u << 10; bytes <= (256u << 20); bytes *= 4) {
        std::vector<float> data(bytes / sizeof(float), 1.0f);
        auto raw = [&] {
            MPI_Allreduce(MPI_IN_PLACE, data.data(), static_cast<int>(data.size()), MPI_FLOAT, MPI_SUM,
                          gradsync::mpi_world());
        };
        auto ours = [&] { backend.allreduce(std::span<float>(data), gradsync::ReduceOp::average); };
        const int shard = static_cast<int>(data.size() / static_cast<std::size_t>(backend.size()));
        auto raw_sharded = [&] {
            MPI_Reduce_scatter_block(MPI_IN_PLACE, data.data(), shard, MPI_FLOAT, MPI_SUM, gradsync::mpi_world());
            MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data.data(), shard, MPI_FLOAT, gradsync::mpi_world());
        };
        auto sharded = [&] {
            backend.reduce_scatter(std::span<float>(data), gradsync::ReduceOp::average);
            backend.all_gather(std::span<float>(data));
        };
        // Each sample times a batch of calls (one call from 4 MiB), so that the barrier before it
        // is a small part of it; 7 samples of each, alternating (1 when --iterations 1 asks for a
        // quick run).
        const int batch = std::max<int>(1, static_cast<int>((32u << 20) / bytes));
        const int samples = s.iterations <= 1 ? 1 : 7;
        auto batched = [batch](const auto& f) {
            return [batch, &f] {
                for (int k = 0; k < batch; ++k) f();
            };
        };
        const auto raw_batch = batched(raw);
        const auto ours_batch = batched(ours);
        const auto raw_sharded_batch = batched(raw_sharded);
        const auto sharded_batch = batched(sharded);
        std::vector<double> raw_s, ours_s, raw_sharded_s, sharded_s;
        for (int i = -1; i < samples; ++i) {  // one warm-up
            const double o = timed(gradsync::mpi_world(), ours_batch) / batch;
            const double r = timed(gradsync::mpi_world(), raw_batch) / batch;
            const double sh = timed(gradsync::mpi_world(), sharded_batch) / batch;
            const double rs = timed(gradsync::mpi_world(), raw_sharded_batch) / batch;
            if (i < 0) continue;
            raw_s.push_back(r);
            ours_s.push_back(o);
            sharded_s.push_back(sh);
            raw_sharded_s.push_back(rs);
        }
        points.push_back({bytes, bench::median(raw_s), bench::median(ours_s), bench::median(raw_sharded_s),
                          bench::median(sharded_s)});
        if (backend.rank() == 0) {
            const auto& p = points.back();
            std::printf(
                "  %9zu KiB   raw MPI_Allreduce %8.2f GB/s   MpiBackend::allreduce %8.2f GB/s   ratio %.3f   "
                "reduce_scatter + all_gather: raw %8.2f GB/s, MpiBackend %8.2f GB/s\n",
                bytes >> 10, double(bytes) / p.raw_s / 1e9, double(bytes) / p.ours_s / 1e9, p.ours_s / p.raw_s,
                double(bytes) / p.raw_sharded_s / 1e9, double(bytes) / p.sharded_s / 1e9);
            std::fflush(stdout);
        }
    }
    return points;
}

}  // namespace

int main(int argc, char** argv) {
    gradsync::MpiSession mpi(argc, argv);
    Settings s;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--iterations" && i + 1 < argc) {
            s.iterations = std::atoi(argv[++i]);
        } else if (a == "--chunk-kib" && i + 1 < argc) {
            s.mpi.chunk = gradsync::Bytes{std::size_t(std::atol(argv[++i])) << 10};
        } else if (a == "--pack-kib" && i + 1 < argc) {
            s.mpi.pack_below = gradsync::Bytes{std::size_t(std::atol(argv[++i])) << 10};
        } else if (a == "--results-name" && i + 1 < argc) {
            s.results = argv[++i];
        } else if (a == "--algorithm" && i + 1 < argc && std::string(argv[i + 1]) == "auto") {
            s.mpi.algorithm = gradsync::MpiAlgorithm::automatic;
            ++i;
        } else if (a == "--algorithm" && i + 1 < argc && std::string(argv[i + 1]) == "ring") {
            s.mpi.algorithm = gradsync::MpiAlgorithm::ring;
            ++i;
        } else if (a == "--algorithm" && i + 1 < argc && std::string(argv[i + 1]) == "mpi") {
            s.mpi.algorithm = gradsync::MpiAlgorithm::mpi_allreduce;
            ++i;
        } else if (a == "--busy") {
            s.busy = true;
        } else if (a == "--in-place-only") {
            s.in_place_only = true;
        } else if (a == "--layout" && i + 1 < argc) {
            s.only = argv[++i];
        } else {
            std::fprintf(stderr,
                         "usage: bench_mpi [--iterations N] [--chunk-kib K] [--pack-kib K] [--algorithm auto|ring|mpi] "
                         "[--layout resnet50|bert_base] [--in-place-only] [--busy] [--results-name NAME]\n");
            return 2;
        }
    }
    int rank = 0, size = 1;
    MPI_Comm_rank(gradsync::mpi_world(), &rank);
    MPI_Comm_size(gradsync::mpi_world(), &size);
    if (rank == 0)
        std::printf(
            "DataParallel<MpiBackend>::synchronize() on %d processes, median of %d iterations (chunk %zu KiB)\n", size,
            s.iterations, s.mpi.chunk.count() >> 10);
    struct Layout {
        const char* name;
        std::vector<layouts::Tensor> (*tensors)();
    };
    std::vector<SweepPoint> sweep;
    if (!s.in_place_only && !s.busy) {
        if (rank == 0) std::printf("Allreduce bandwidth (algbw = busbw for 2 processes), median of the iterations:\n");
        sweep = bandwidth_sweep(s);
    }
    // The same load as the in-process benchmark's: one busy thread per core, shared out.
    std::optional<bench::BusyNeighbours> busy;
    if (s.busy) {
        const unsigned threads = std::max(1u, std::thread::hardware_concurrency() / unsigned(size));
        busy.emplace(threads);
        if (rank == 0) std::printf("beside %u busy-looping thread(s) in each process\n", threads);
    }
    std::vector<Row> rows;
    std::vector<StepPair> steps;
    std::vector<HookPair> hooks;
    for (auto layout : {Layout{"resnet50", layouts::resnet50}, Layout{"bert_base", layouts::bert_base}}) {
        if (!s.only.empty() && s.only != layout.name) continue;
        const auto tensors = layout.tensors();
        const std::string n = layout.name;
        rows.push_back(measure(n + "/in_place", tensors, s));
        if (s.in_place_only) continue;
        rows.push_back(measure(n + "/packed", tensors, s, gradsync::PackedBuckets{}));
        rows.push_back(measure(n + "/bf16_wire", tensors, s, gradsync::Bf16Compression{}));
        if (!s.busy) {
            steps.push_back(sharded_step(n + "/sharded_step", tensors, s.mpi, s.iterations));
            hooks.push_back(powersgd_step(n + "/powersgd_step", tensors, s.mpi, std::min(s.iterations, 5)));
        }
    }
    if (rank == 0) {
        std::printf(
            "\nsummary (target: in_place synchronize <= 1.05 x raw MPI_Allreduce of the same gradients, per tensor)\n");
        for (const auto& r : rows)
            std::printf(
                "  %-22s %8.2f ms   ratio to raw flat %.3f   to raw per tensor %.3f%s\n", r.name.c_str(), r.ms, r.ratio,
                r.ratio_pieces,
                r.name.ends_with("/in_place") && !s.busy ? (r.ratio_pieces <= 1.05 ? " (met)" : " (MISSED)") : "");
        // A figure that is not a finite positive number means a benchmark broke.
        bool broken = false;
        for (const auto& r : rows) {
            const bool shared_sane =
                !r.name.ends_with("/in_place") || (bench::sane(r.shared_ms) && bench::sane(r.copy_ms));
            if (bench::sane(r.ms) && bench::sane(r.ratio) && bench::sane(r.ratio_pieces) && shared_sane) continue;
            std::printf("BROKEN: %s: not a finite positive figure\n", r.name.c_str());
            broken = true;
        }
        for (const auto& p : steps) {
            if (bench::sane(p.sharded_ms) && bench::sane(p.unsharded_ms) && bench::sane(p.ratio)) continue;
            std::printf("BROKEN: %s: not a finite positive figure\n", p.name.c_str());
            broken = true;
        }
        for (const auto& h : hooks) {
            if (bench::sane(h.hooked_ms) && bench::sane(h.plain_ms) && bench::sane(h.wire_ratio)) continue;
            std::printf("BROKEN: %s: not a finite positive figure\n", h.name.c_str());
            broken = true;
        }
        if (broken) return 1;
        std::vector<bench::SummaryRow> summary;
        const std::string load = s.busy ? " beside busy threads" : "";
        for (const auto& r : rows) {
            const bool targeted = r.name.ends_with("/in_place") && !s.busy;
            summary.push_back({"MpiBackend synchronize() " + r.name + load + " / raw flat", r.ms, "ms",
                               "raw MPI_Allreduce", r.raw_ms, "", r.ratio, "-", true});
            summary.push_back({"MpiBackend synchronize() " + r.name + load + " / raw per tensor", r.ms, "ms",
                               "raw MPI_Allreduce per tensor", r.pieces_ms, "", r.ratio_pieces,
                               targeted ? "<= 1.05" : "-", !targeted || r.ratio_pieces <= 1.05});
            if (r.shared_ms > 0)
                summary.push_back({"SharedMemoryBackend synchronize() " + r.name + load + " / MpiBackend's",
                                   r.shared_ms, "ms", "MpiBackend synchronize()", r.ms, "", r.shared_ms / r.ms, "-",
                                   true});
            summary.push_back({"MpiBackend synchronize() " + r.name + load + ", slowest / fastest iteration",
                               r.slowest_ms, "ms", "fastest", r.fastest_ms, "", r.slowest_ms / r.fastest_ms, "-",
                               true});
        }
        for (const auto& p : steps)
            summary.push_back({"MpiBackend ShardedDataParallel step " + p.name + " / DataParallel step", p.sharded_ms,
                               "ms", "DataParallel step (allreduce)", p.unsharded_ms, "", p.ratio, "<= 1.10",
                               p.ratio <= 1.10});
        for (const auto& h : hooks) {
            summary.push_back({"MpiBackend PowerSGD rank 4 values sent " + h.name + " / plain allreduce", h.sent_mb,
                               "MB", "plain allreduce", h.plain_mb, "", h.wire_ratio, "-", true});
            summary.push_back({"MpiBackend PowerSGD rank 4 step " + h.name + " / DataParallel step", h.hooked_ms, "ms",
                               "DataParallel step (allreduce)", h.plain_ms, "", h.ratio, "-", true});
        }
        nlohmann::json points = nlohmann::json::array();
        for (const auto& p : sweep) {
            if (!bench::sane(p.raw_s) || !bench::sane(p.ours_s) || !bench::sane(p.raw_sharded_s) ||
                !bench::sane(p.sharded_s)) {
                std::printf("BROKEN: collectives of %zu bytes: not a finite positive time\n", p.bytes);
                return 1;
            }
            points.push_back({{"bytes", p.bytes},
                              {"raw_s", p.raw_s},
                              {"gradsync_s", p.ours_s},
                              {"raw_sharded_s", p.raw_sharded_s},
                              {"gradsync_sharded_s", p.sharded_s}});
            // The sharded pair against our allreduce and against raw MPI's pair, at the largest
            // size the step's buckets reach.
            if (p.bytes != (64u << 20)) continue;
            summary.push_back({"MpiBackend reduce_scatter + all_gather, 64 MiB / MpiBackend allreduce",
                               p.sharded_s * 1e3, "ms", "MpiBackend allreduce", p.ours_s * 1e3, "",
                               p.sharded_s / p.ours_s, "<= 1.10", p.sharded_s / p.ours_s <= 1.10});
            summary.push_back({"MpiBackend reduce_scatter + all_gather, 64 MiB / raw MPI pair", p.sharded_s * 1e3, "ms",
                               "raw MPI_Reduce_scatter_block + MPI_Allgather", p.raw_sharded_s * 1e3, "",
                               p.sharded_s / p.raw_sharded_s, "-", true});
        }
        bench::write_summary_rows(s.results, summary, {{"bandwidth", points}});
    }
    return 0;
}
