// The overlap benchmark's part of the summary: the table of every plan at every comm/compute
// ratio, autotuning against the fixed caps, and the worst figures the targets are set on.
#pragma once

#include <algorithm>  // for std::max
#include <cstdio>
#include <map>
#include <string>
#include <utility>  // for std::pair
#include <vector>

namespace bench {

struct Worst {
    double ratio = 0;
    std::string where;
};

// Exposed above the floor no plan can go below (one bucket per layer, a perfect engine).
struct AboveFloor {
    double exposed_ms = 0, floor_ms = 0;
    std::string where;
};

// Over comm/compute <= 1: exposed / last bucket of the untuned default plan (8 MiB growing), of
// PyTorch DDP's (25 MiB, filled forward) and of autotuning (LocalBackend's default); autotuned
// exposed / the best fixed cap; autotuned exposed above the floor, where the most.
struct OverlapWorst {
    Worst defaults, ddp, tuned, tuned_vs_sweep;
    AboveFloor tuned_above_floor;
};

// "25 MiB", "8 MiB growing": a plan's label ("25", "8grow") for a reader.
inline std::string cap_text(const std::string& cap) {
    const auto grow = cap.find("grow");
    return grow == std::string::npos ? cap + " MiB" : cap.substr(0, grow) + " MiB growing";
}

// From the medians of the overlap benchmarks' counters, by "name/args": one benchmark per layout
// and ratio, its counters per plan ("<cap>.exposed_ms") beside those its plans share.
inline OverlapWorst print_overlap(const std::map<std::string, std::map<std::string, double>>& median_counters) {
    std::printf(
        "\nOverlap with a synthetic backward (2 ranks; every plan of a layout and ratio interleaved step by step in "
        "one\n"
        "run, medians of its steps; times in ms; exposed = overlapped - compute;\n"
        "plan bound = the exposure the bucket plan leaves even a perfect engine; floor = the least plan bound of\n"
        "any plan (a bucket per layer: where comm matches compute, the largest layer's communication); cap auto =\n"
        "the default on "
        "LocalBackend, autotuned from 8 MiB growing along backward; cap 8grow = that plan untuned (the\n"
        "default where tuning is off); cap 25 = PyTorch DDP's plan)\n");
    std::printf("  %-10s %5s %6s %8s %8s %11s %11s %8s %11s %6s %12s %13s\n", "layout", "cap", "comm/c", "compute",
                "comm", "sequential", "overlapped", "exposed", "plan bound", "floor", "last bucket", "exposed/last");
    OverlapWorst worst;
    // Per layout and comm/compute: exposed ms of the default plan, the best fixed cap, autotuned.
    struct Versus {
        double defaults = 0, best = 0, tuned = 0, tuned_buckets = 0;
        std::string best_cap;
    };
    std::map<std::pair<std::string, std::string>, Versus> versus;
    for (const auto& [key, counters] : median_counters) {
        if (key.rfind("overlap/", 0) != 0) continue;
        const std::string layout = key.substr(8, key.find('/', 8) - 8);
        const auto at = key.find("comm_to_compute:");
        if (at == std::string::npos) continue;
        const std::string ratio_text = key.substr(at + 16);
        const double ratio = std::stod(ratio_text);
        std::vector<std::string> caps;  // the plans measured, by their "<cap>.exposed_ms"
        for (const auto& [name, value] : counters)
            if (name.size() > 11 && name.ends_with(".exposed_ms")) caps.push_back(name.substr(0, name.size() - 11));
        for (const auto& cap : caps) {
            // A plan's own figure, or one its cell shares (compute, comm, sequential, floor).
            auto get = [&](const char* name) {
                auto own = counters.find(cap + "." + name);
                if (own != counters.end()) return own->second;
                auto shared = counters.find(name);
                return shared != counters.end() ? shared->second : 0.0;
            };
            std::printf("  %-10s %5s %6.2f %8.2f %8.2f %11.2f %11.2f %8.2f %11.2f %6.2f %12.2f %13.2f\n",
                        layout.c_str(), cap.c_str(), ratio, get("compute_ms"), get("comm_ms"), get("sequential_ms"),
                        get("overlapped_ms"), get("exposed_ms"), get("plan_bound_ms"), get("floor_ms"),
                        get("last_bucket_ms"), get("exposed_ms") / std::max(get("last_bucket_ms"), 1e-9));
            auto& v = versus[{layout, ratio_text}];
            if (ratio <= 1.0 && get("last_bucket_ms") > 0 && (cap == "auto" || cap == "25" || cap == "8grow")) {
                const double r = get("exposed_ms") / get("last_bucket_ms");
                auto& w = cap == "auto" ? worst.tuned : cap == "25" ? worst.ddp : worst.defaults;
                char floor[96];
                std::snprintf(floor, sizeof floor, " (floor %.2f, last %.2f ms)", get("floor_ms"),
                              get("last_bucket_ms"));
                if (r > w.ratio) w = {r, layout + " at comm/compute " + ratio_text + floor};
                auto& above = worst.tuned_above_floor;
                if (cap == "auto" &&
                    (above.where.empty() || get("exposed_ms") - get("floor_ms") > above.exposed_ms - above.floor_ms))
                    above = {get("exposed_ms"), get("floor_ms"), layout + " at comm/compute " + ratio_text};
            }
            if (cap == "auto") {
                v.tuned = get("exposed_ms");
                v.tuned_buckets = get("buckets");
            } else {
                if (cap == "8grow") v.defaults = get("exposed_ms");
                if (v.best_cap.empty() || get("exposed_ms") < v.best)
                    v = {v.defaults, get("exposed_ms"), v.tuned, v.tuned_buckets, cap};
            }
        }
    }
    std::printf(
        "\nAutotuned buckets (Options::autotune_buckets, on by default here) against fixed caps: exposed ms after "
        "backward (below 0.1 ms "
        "counts as "
        "0.1)\n  %-10s %6s %9s %16s %18s %12s\n",
        "layout", "comm/c", "8grow", "best fixed (MiB)", "autotuned (buckets)", "auto / best");
    for (const auto& [where, v] : versus) {
        const double r = std::max(v.tuned, 0.1) / std::max(v.best, 0.1);
        std::printf("  %-10s %6s %9.2f %11.2f (%2s) %12.2f (%3.0f) %12.2f\n", where.first.c_str(), where.second.c_str(),
                    v.defaults, v.best, v.best_cap.c_str(), v.tuned, v.tuned_buckets, r);
        if (std::stod(where.second) <= 1.0 && r > worst.tuned_vs_sweep.ratio)
            worst.tuned_vs_sweep = {
                r, where.first + " at comm/compute " + where.second + ", best fixed " + cap_text(v.best_cap)};
    }
    return worst;
}

}  // namespace bench
