// Runs every benchmark, then prints a summary: each figure beside its ceiling or baseline
// measured in the same run, their ratio, and the target set for it. Fails (exit status 1) when
// a figure of the summary was not produced (unless --benchmark_filter chose fewer) or is not a
// finite positive number: a benchmark that broke. --quick runs each benchmark once and briefly,
// for that check alone.
#include <benchmark/benchmark.h>

#include <gradsync/data_parallel/options.hpp>

#include "metrics_summary.hpp"
#include "overlap_summary.hpp"
#include "results.hpp"
#include "sharded_summary.hpp"
#include "summary_table.hpp"
#include "summary_rows.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace bench;  // the summary table (summary_table.hpp)

// The console output as usual, and each median kept for the summary.
class Recorder : public benchmark::ConsoleReporter {
public:
    // Tabular, without colour codes (a reporter of our own does not see --benchmark_color).
    Recorder() : ConsoleReporter(OO_Tabular) {}

    void ReportRuns(const std::vector<Run>& runs) override {
        for (const auto& run : runs) {
            // Medians of repeated benchmarks; single runs (which take their own medians) as they are.
            const bool repeated = run.repetitions > 1;
            std::string key = run.run_name.function_name;
            if (!run.run_name.args.empty()) key += "/" + run.run_name.args;
            const double seconds = run.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(run.time_unit);
            if (repeated && run.run_type == Run::RT_Aggregate && run.aggregate_name == "min")
                spread_seconds[key].first = seconds;
            if (repeated && run.run_type == Run::RT_Aggregate && run.aggregate_name == "max")
                spread_seconds[key].second = seconds;
            if (repeated && (run.run_type != Run::RT_Aggregate || run.aggregate_name != "median")) continue;
            median_seconds[key] = seconds;
            for (const auto& [name, counter] : run.counters) median_counters[key][name] = counter.value;
        }
        ConsoleReporter::ReportRuns(runs);
    }
};

void print_summary() {
    std::printf(
        "\n== gradsync summary: medians of the repetitions above; every ratio is against a ceiling or "
        "baseline measured in this run ==\n\n");
    std::printf(
        "LocalBackend allreduce, 2 ranks (busbw = algbw * 2(n-1)/n = algbw for n = 2; memcpy = bytes "
        "copied per second by one thread)\n");
    std::printf("  %-9s %12s %12s %12s %14s %14s\n", "size", "time (us)", "algbw GB/s", "busbw GB/s", "memcpy GB/s",
                "busbw/memcpy");
    for (long long bytes = 4 << 10; bytes <= (256ll << 20); bytes *= 4) {
        auto t = seconds("allreduce_2_ranks/bytes:" + std::to_string(bytes));
        auto m = seconds("memcpy/bytes:" + std::to_string(bytes));
        if (!t || !m) continue;
        double algbw = gbps(double(bytes), *t), copy = gbps(double(bytes), *m);
        std::printf("  %-9s %12.1f %12.2f %12.2f %14.2f %14.3f", size_name(bytes).c_str(), *t * 1e6, algbw, algbw, copy,
                    algbw / copy);
        std::printf("\n");
    }
    std::printf(
        "\nIn cache, 2 ranks, each figure taken in turn in every iteration (ratios: medians of the per-iteration "
        "ratios;\n  repeated = the allreduce repeated on the same buffers, each rank's share in its own cache; "
        "after write = each\n  rank writes its buffer first, as backward does, so that half of what it reads "
        "crosses between the cores;\n  cross-core = memcpy of a buffer the other core has just written, the "
        "ceiling of that crossing)\n");
    std::printf("  %-9s %11s %13s %14s %15s %16s %14s\n", "size", "memcpy (us)", "repeated (us)", "busbw/memcpy",
                "cross-core (us)", "after write (us)", "x-core/after");
    double worst_in_cache = 0;  // the lowest busbw / memcpy from 64 KiB to 4 MiB
    double worst_after = 0;     // the lowest cross-core copy / allreduce after a write, the same sizes
    for (long long bytes = 4 << 10; bytes <= (4 << 20); bytes *= 4) {
        const std::string key = "in_cache_2_ranks/bytes:" + std::to_string(bytes);
        auto copy = counter(key, "memcpy_us"), repeated = counter(key, "allreduce_us"),
             across = counter(key, "cross_core_us"), after = counter(key, "after_write_us"),
             ratio = counter(key, "busbw_over_memcpy"), after_ratio = counter(key, "after_write_over_cross_core");
        if (!copy || !repeated || !across || !after || !ratio || !after_ratio) continue;
        std::printf("  %-9s %11.2f %13.2f %14.3f %15.2f %16.2f %14.3f\n", size_name(bytes).c_str(), *copy, *repeated,
                    *ratio, *across, *after, *after_ratio);
        if (bytes >= (64 << 10)) {
            worst_in_cache = worst_in_cache == 0 ? *ratio : std::min(worst_in_cache, *ratio);
            worst_after = worst_after == 0 ? *after_ratio : std::min(worst_after, *after_ratio);
        }
    }
    if (auto x = seconds("two_meetings"))
        std::printf("  two threads meeting twice (the floor of a collective's latency): %.2f us\n", *x * 1e6);
    std::printf("\nLocalBackend allreduce latency, 2 ranks\n");
    double worst_small = 0;
    for (long long bytes : {4, 16, 64, 256, 1024, 4096}) {
        auto t = seconds("allreduce_latency_2_ranks/bytes:" + std::to_string(bytes));
        if (!t) continue;
        if (bytes <= 256) worst_small = std::max(worst_small, *t);
        std::printf("  %-9s %8.2f us\n", size_name(bytes).c_str(), *t * 1e6);
    }

    std::printf(
        "\nDataParallel::synchronize(), 2 ranks, against one allreduce of a flat buffer of the same bytes,\n"
        "interleaved in every iteration; ratio = median of the per-iteration ratios\n");
    for (const char* layout : {"resnet50", "bert_base"}) {
        for (const char* mode : {"in_place", "packed"}) {
            std::string key = std::string("synchronize_vs_flat/") + layout + "/" + mode;
            auto sync = counter(key, "sync_ms"), flat = counter(key, "flat_ms"), ratio = counter(key, "ratio");
            if (!sync || !flat || !ratio) continue;
            std::printf("  %-10s %-9s %9.2f ms   flat %9.2f ms   ratio %6.3f\n", layout, mode, *sync, *flat, *ratio);
        }
    }
    // Beside one busy-looping thread per core: median (fastest - slowest) of the repetitions.
    std::printf(
        "\nUnder load: LocalBackend, 2 ranks, beside one busy-looping thread per core (median, fastest - "
        "slowest of %d runs)\n",
        bench::repetitions_of(5));
    auto spread = [](const std::string& key) {
        auto it = spread_seconds.find(key);
        return it == spread_seconds.end() ? std::pair(0.0, 0.0) : it->second;
    };
    double busy_worst = 0, busy_ratio = 0, busy_bw = 0, busy_copy = 0;
    for (long long bytes : {4, 256}) {
        const std::string key = "busy/allreduce_latency_2_ranks/bytes:" + std::to_string(bytes);
        auto t = seconds(key);
        if (!t) continue;
        busy_worst = std::max(busy_worst, *t);
        std::printf("  allreduce %-6s %8.2f us (%.2f - %.2f)\n", size_name(bytes).c_str(), *t * 1e6,
                    spread(key).first * 1e6, spread(key).second * 1e6);
    }
    const std::string busy_all = "busy/allreduce_2_ranks/bytes:" + std::to_string(64 << 20),
                      busy_mem = "busy/memcpy/bytes:" + std::to_string(64 << 20);
    if (auto t = seconds(busy_all), m = seconds(busy_mem); t && m) {
        busy_bw = gbps(double(64 << 20), *t);
        busy_copy = gbps(double(64 << 20), *m);
        busy_ratio = busy_bw / busy_copy;
        std::printf("  allreduce 64 MiB %6.2f GB/s (%.2f - %.2f), memcpy %.2f GB/s (%.2f - %.2f)\n", busy_bw,
                    gbps(double(64 << 20), spread(busy_all).second), gbps(double(64 << 20), spread(busy_all).first),
                    busy_copy, gbps(double(64 << 20), spread(busy_mem).second),
                    gbps(double(64 << 20), spread(busy_mem).first));
    }

    std::printf(
        "\nMemory held beyond the model (DataParallel buffers + backend staging), against the gradient bytes\n");
    for (const auto& [key, m] : memory) {
        std::printf("  %-20s %12s of %12s   ratio %6.3f\n", key.c_str(), gradsync::to_string(m.first).c_str(),
                    gradsync::to_string(m.second).c_str(), double(m.first.count()) / double(m.second.count()));
    }

    const auto overlap = bench::print_overlap(median_counters);
    auto copy_view = counter("views_vs_copies/resnet50", "copy_over_view");

    std::printf("\nMixed precision\n");
    const std::string fin = "finalize/64MiB";
    auto fused_bw = counter(fin, "fused_GBps"), copy_bw = counter(fin, "memcpy_GBps");
    auto fused_ms = counter(fin, "fused_ms"), unfused_ms = counter(fin, "unfused_ms");
    if (fused_bw && copy_bw && fused_ms && unfused_ms) {
        std::printf(
            "  finalize pass over 64 MiB of float32 (bytes read + written): fused %.1f GB/s, memcpy %.1f GB/s;\n"
            "  fused %.2f ms, unfused sequence (average, unscale, check, norm) %.2f ms\n",
            *fused_bw, *copy_bw, *fused_ms, *unfused_ms);
    }
    const std::string comp = "compression/resnet50";
    auto f_in = counter(comp, "float_in_place_ms"), f_packed = counter(comp, "float_packed_ms");
    auto h_ms = counter(comp, "fp16_ms"), b_ms = counter(comp, "bf16_ms");
    if (f_in && f_packed && h_ms && b_ms) {
        std::printf(
            "  synchronize() on ResNet-50, 2 ranks: float32 in place %.2f ms, float32 packed %.2f ms,\n"
            "  float16 on the wire %.2f ms, bfloat16 on the wire %.2f ms\n",
            *f_in, *f_packed, *h_ms, *b_ms);
    }
    const std::string f32r = "float32_reduction/resnet50";
    auto brain_ms = counter(f32r, "bf16_ms"), brain_wide_ms = counter(f32r, "bf16_in_float32_ms");
    auto float_ms = counter(f32r, "float32_ms");
    if (brain_ms && brain_wide_ms && float_ms) {
        std::printf(
            "  synchronize() on ResNet-50 in bfloat16, 2 ranks: averaged in bfloat16 %.2f ms, in float32\n"
            "  (AllreduceHook) %.2f ms = %.2fx the float32 model's %.2f ms (the same bytes on the wire)\n",
            *brain_ms, *brain_wide_ms, *brain_wide_ms / *float_ms, *float_ms);
    }

    std::printf("\nTargets: collectives and synchronize()\n");
    std::printf("  %-46s %-12s %-26s %6s   %-9s %s\n", "figure", "measured", "ceiling / baseline", "ratio", "target",
                "");
    auto ar = seconds("allreduce_2_ranks/bytes:67108864");
    auto mc = seconds("memcpy/bytes:67108864");
    if (!ar || !mc) missing("allreduce busbw at 64 MiB");
    if (ar && mc) {
        double busbw = gbps(64.0 * (1 << 20), *ar), copy = gbps(64.0 * (1 << 20), *mc);
        target_row("allreduce busbw at 64 MiB / memcpy at 64 MiB", shown("%.2f", busbw, "GB/s"),
                   shown("%.2f", copy, "GB/s", "memcpy"), busbw / copy, ">= 0.70", busbw / copy >= 0.70);
    }
    if (worst_in_cache <= 0) missing("allreduce busbw / memcpy in cache");
    if (worst_in_cache > 0)
        target_row("allreduce busbw/memcpy in cache, worst 64K..4M", shown("%.3f", worst_in_cache, ""),
                   label_only("memcpy"), worst_in_cache, ">= 0.60", worst_in_cache >= 0.60);
    if (worst_after > 0)
        target_row("after write, cross-core copy/allreduce, worst", shown("%.3f", worst_after, ""),
                   label_only("cross-core"), worst_after, "-", true);
    auto latency_4k = seconds("allreduce_latency_2_ranks/bytes:4096");
    auto meetings = seconds("two_meetings");
    if (!latency_4k || !meetings) missing("allreduce 4 KiB latency");
    if (latency_4k && meetings)
        target_row("allreduce 4 KiB latency / two meetings", shown("%.2f", *latency_4k * 1e6, "us"),
                   shown("%.2f", *meetings * 1e6, "us", "meet"), *latency_4k / *meetings, "<= 1 us",
                   *latency_4k <= 1e-6);
    if (worst_small <= 0) missing("allreduce 4..256 B latency");
    if (worst_small > 0) {
        target_row("allreduce 4..256 B, worst median latency", shown("%.2f", worst_small * 1e6, "us"), label_only("-"),
                   worst_small * 1e6 / 5.0, "<= 5 us", worst_small <= 5e-6);
    }
    bench::sharded_rows();
    bench::metrics_rows();
    const std::string resnet = "synchronize_vs_flat/resnet50/in_place";
    auto sync = counter(resnet, "sync_ms"), flat = counter(resnet, "flat_ms"), ratio = counter(resnet, "ratio");
    if (!sync || !flat || !ratio) missing("synchronize() ResNet-50 / flat allreduce");
    if (sync && flat && ratio) {
        target_row("synchronize() ResNet-50 / flat allreduce", shown("%.2f", *sync, "ms"),
                   shown("%.2f", *flat, "ms", "flat"), *ratio, "<= 1.10", *ratio <= 1.10);
    }
    // Gradients that are not one buffer, copied into buckets and back (PackedBuckets).
    for (const char* layout : {"resnet50", "bert_base"}) {
        const std::string key = std::string("synchronize_vs_flat/") + layout + "/packed";
        auto packed = counter(key, "sync_ms"), flat_ms = counter(key, "flat_ms"), r = counter(key, "ratio");
        if (!packed || !flat_ms || !r) {
            missing(key);
            continue;
        }
        const std::string name = layout_title(layout);
        target_row("synchronize() packed / flat allreduce, " + name, shown("%.2f", *packed, "ms"),
                   shown("%.2f", *flat_ms, "ms", "flat"), *r, "<= 1.50", *r <= 1.50);
    }
    for (const char* layout : {"resnet50", "bert_base"}) {
        const std::string key = std::string("replica_check/") + layout;
        auto check = counter(key, "check_ms"), sync_ms = counter(key, "sync_ms");
        if (!check || !sync_ms) {
            missing(key);
            continue;
        }
        const double every = static_cast<double>(gradsync::Options::replica_check_default);
        const std::string name = layout_title(layout);
        target_row("replica check, amortized / sync, " + name, shown("%.3f", *check / every, "ms"),
                   shown("%.2f", *sync_ms, "ms", "sync"), *check / every / *sync_ms, "<= 0.01",
                   *check / every / *sync_ms <= 0.01);
        auto list_us = counter(key, "list_us"), buckets = counter(key, "buckets");
        if (list_us && buckets) {
            // Following moved gradient storage: one listing of the model per plain step, one per
            // bucket launched during an overlapped one (Options::storage_may_move = false: none).
            const double plain = *list_us / 1e3, overlapped = plain * *buckets;
            target_row("model listing, plain step / sync, " + name, shown("%.1f", plain * 1e3, "us"),
                       shown("%.2f", *sync_ms, "ms", "sync"), plain / *sync_ms, "<= 0.01", plain / *sync_ms <= 0.01);
            target_row("model listings, overlapped / sync, " + name, shown("%.1f", overlapped * 1e3, "us"),
                       shown("%.2f", *sync_ms, "ms", "sync"), overlapped / *sync_ms, "-", true);
        }
    }
    if (!memory.count("resnet50/in_place")) missing("extra memory ResNet-50");
    if (auto it = memory.find("resnet50/in_place"); it != memory.end()) {
        double ratio = double(it->second.first.count()) / double(it->second.second.count());
        target_row("extra memory ResNet-50 / gradient bytes", shown_bytes(it->second.first),
                   shown_bytes(it->second.second, "grads"), ratio, "<= 1.00", ratio <= 1.0);
    }
    if (busy_worst <= 0 || busy_ratio <= 0) missing("under load");
    if (busy_worst > 0)
        target_row("allreduce 4..256 B under load, worst median latency", shown("%.2f", busy_worst * 1e6, "us"),
                   label_only("-"), busy_worst * 1e6 / 5.0, "<= 5 us", busy_worst <= 5e-6);
    if (busy_ratio > 0)
        target_row("allreduce busbw / memcpy at 64 MiB, under load", shown("%.2f", busy_bw, "GB/s"),
                   shown("%.2f", busy_copy, "GB/s", "memcpy"), busy_ratio, ">= 0.70", busy_ratio >= 0.70);
    std::printf("\nTargets: overlap and views\n");
    if (overlap.tuned.ratio <= 0) missing("exposed / last bucket, by default (autotuned)");
    if (overlap.tuned.ratio > 0) {
        target_row("exposed / last bucket, comm <= compute, worst (default: tuned)",
                   shown("%.2f", overlap.tuned.ratio, "x"), label_only(overlap.tuned.where), overlap.tuned.ratio,
                   "<= 1.50", overlap.tuned.ratio <= 1.5);
    }
    if (overlap.defaults.ratio <= 0) missing("exposed / last bucket, untuned");
    if (overlap.defaults.ratio > 0) {
        target_row("the same, untuned default plan (8 MiB growing)", shown("%.2f", overlap.defaults.ratio, "x"),
                   label_only(overlap.defaults.where), overlap.defaults.ratio, "<= 1.50",
                   overlap.defaults.ratio <= 1.5);
    }
    if (overlap.ddp.ratio <= 0) missing("exposed / last bucket, PyTorch DDP's plan");
    if (overlap.ddp.ratio > 0) {
        target_row("the same, PyTorch DDP's plan (25 MiB, filled forward)", shown("%.2f", overlap.ddp.ratio, "x"),
                   label_only(overlap.ddp.where), overlap.ddp.ratio, "-", true);
    }
    if (overlap.tuned_vs_sweep.ratio <= 0) missing("autotuned / best fixed cap");
    if (overlap.tuned_vs_sweep.ratio > 0) {
        target_row("autotuned exposed / best fixed cap, comm <= compute, worst",
                   shown("%.2f", overlap.tuned_vs_sweep.ratio, "x"), label_only(overlap.tuned_vs_sweep.where),
                   overlap.tuned_vs_sweep.ratio, "<= 1.10", overlap.tuned_vs_sweep.ratio <= 1.1);
    }
    if (overlap.tuned_above_floor.where.empty()) missing("autotuned exposed beside the floor");
    if (!overlap.tuned_above_floor.where.empty()) {
        const auto& above = overlap.tuned_above_floor;
        target_row("autotuned exposed / the floor any plan leaves, most above it (" + above.where + ")",
                   shown("%.2f", above.exposed_ms, "ms"), shown("%.2f", above.floor_ms, "ms", "floor"),
                   above.exposed_ms / std::max(above.floor_ms, 1e-6), "-", true);
    }
    if (!copy_view) missing("views_vs_copies/resnet50");
    if (copy_view) {
        auto copy = counter("views_vs_copies/resnet50", "copy_ms"),
             view = counter("views_vs_copies/resnet50", "view_ms");
        target_row("ResNet-50 synchronize(): pack/unpack / views", shown("%.2f", *view, "ms"),
                   shown("%.2f", *copy, "ms", "copies"), *copy_view, ">= 1.20", *copy_view >= 1.2);
    }
    std::printf("\nTargets: mixed precision\n");
    if (!fused_bw || !copy_bw || !fused_ms || !unfused_ms) missing(fin);
    if (fused_bw && copy_bw && fused_ms && unfused_ms) {
        target_row("fused finalize / memcpy, bytes read + written", shown("%.1f", *fused_bw, "GB/s"),
                   shown("%.1f", *copy_bw, "GB/s", "memcpy"), *fused_bw / *copy_bw, ">= 0.80",
                   *fused_bw / *copy_bw >= 0.8);
        target_row("unfused sequence / fused finalize", shown("%.2f", *fused_ms, "ms"),
                   shown("%.2f", *unfused_ms, "ms", "unfused"), *unfused_ms / *fused_ms, ">= 2.50",
                   *unfused_ms / *fused_ms >= 2.5);
    }
    if (!f_in || !b_ms) missing(comp);
    if (f_in && b_ms) {
        target_row("ResNet-50 synchronize(): float32 / bfloat16 wire", shown("%.2f", *b_ms, "ms"),
                   shown("%.2f", *f_in, "ms", "float32"), *f_in / *b_ms, ">= 1.60", *f_in / *b_ms >= 1.6);
    }
}

}  // namespace

namespace bench {
void record_memory(const std::string& key, gradsync::Bytes extra, gradsync::Bytes gradients) {
    std::lock_guard lock(memory_mutex);
    memory[key] = {extra, gradients};
}
}  // namespace bench

namespace bench {
bool quick() { return quick_mode; }
}  // namespace bench

int main(int argc, char** argv) {
    // --quick is ours; the rest go to Google Benchmark.
    for (int i = 1; i < argc; ++i) {
        if (std::strncmp(argv[i], "--benchmark_filter", 18) == 0) filtered = true;
        if (std::strcmp(argv[i], "--quick") != 0) continue;
        quick_mode = true;
        std::copy(argv + i + 1, argv + argc + 1, argv + i);  // argv[argc] is null
        --argc;
        --i;
    }
    bench::register_collectives();
    bench::register_data_parallel();
    bench::register_overlap();
    bench::register_amp();
    bench::register_gather_behind();
    bench::register_metrics();
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    Recorder recorder;
    benchmark::RunSpecifiedBenchmarks(&recorder);
    benchmark::Shutdown();
    print_summary();
    // Every median beside the summary's rows, for the plots.
    nlohmann::json extra = {{"quick", quick_mode},
                            {"seconds", median_seconds},
                            {"counters", median_counters},
                            {"spread_seconds", spread_seconds}};
    bench::write_summary_rows("local", rows, extra);
    if (quick_mode) std::printf("\n(quick mode: each benchmark ran once and briefly; the figures mean nothing)\n");
    if (broken.empty()) return 0;
    std::printf("\nBROKEN: %zu figure(s) of the summary:\n", broken.size());
    for (const auto& figure : broken) std::printf("  %s\n", figure.c_str());
    return 1;
}
