// The summary table bench_main.cpp prints after the run: the medians the reporter kept, and how a
// figure is shown beside its same-run ceiling or baseline (target_row), also kept for the results
// file. For bench_main.cpp and the parts of the summary it includes.
#pragma once

#include <gradsync/bytes.hpp>

#include "summary_rows.hpp"

#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bench {

inline std::map<std::string, double> median_seconds;                          // by "name/args"
inline std::map<std::string, std::map<std::string, double>> median_counters;  // by "name/args", counter
inline std::map<std::string, std::pair<double, double>> spread_seconds;       // fastest and slowest repetition
inline std::map<std::string, std::pair<gradsync::Bytes, gradsync::Bytes>> memory;
inline std::mutex memory_mutex;
inline bool quick_mode = false;
inline bool filtered = false;            // --benchmark_filter: the summary has only the figures asked for
inline std::vector<std::string> broken;  // figures of the summary not produced, or not finite and positive

inline void missing(const std::string& figure) {
    if (!filtered) broken.push_back(figure + ": not produced");
}

inline std::optional<double> counter(const std::string& key, const std::string& name) {
    auto it = median_counters.find(key);
    if (it == median_counters.end() || !it->second.count(name)) return std::nullopt;
    return it->second.at(name);
}

inline std::optional<double> seconds(const std::string& key) {
    auto it = median_seconds.find(key);
    if (it == median_seconds.end()) return std::nullopt;
    return it->second;
}

inline std::string size_name(long long bytes) {
    if (bytes >= (1 << 20)) return std::to_string(bytes >> 20) + " MiB";
    if (bytes >= (1 << 10)) return std::to_string(bytes >> 10) + " KiB";
    return std::to_string(bytes) + " B";
}

inline double gbps(double bytes, double s) { return bytes / s / 1e9; }

// The model a layout key starts with ("resnet50...", "bert_base..."), as the summary names it.
inline std::string layout_title(std::string_view layout) {
    return layout.starts_with("resnet50") ? "ResNet-50" : "BERT-base";
}

inline std::string fmt(const char* format, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, format, v);
    return buf;
}

// A number as the summary prints it ("memcpy 5.58 GB/s") and as the results file keeps it.
struct Shown {
    std::string text;
    double value = std::nan("");
    std::string unit;
    std::string label;
};
inline Shown shown(const char* format, double value, const char* unit, const std::string& label = {}) {
    return {(label.empty() ? "" : label + " ") + fmt(format, value) + " " + unit, value, unit, label};
}
inline Shown shown_bytes(gradsync::Bytes b, const std::string& label = {}) {
    return {(label.empty() ? "" : label + " ") + gradsync::to_string(b), double(b.count()), "B", label};
}
inline Shown label_only(const std::string& label) { return {label, std::nan(""), "", label}; }

inline std::vector<SummaryRow> rows;  // for the results file

inline void target_row(const std::string& figure, const Shown& measured, const Shown& reference, double ratio,
                       const char* target, bool met) {
    const bool informative = target[0] == '-';  // a figure shown beside its reference, with no target
    if (!sane(ratio)) broken.push_back(figure + ": ratio " + fmt("%g", ratio));
    std::printf("  %-46s %-12s %-26s %6.3f   %-9s %s\n", figure.c_str(), measured.text.c_str(), reference.text.c_str(),
                ratio, target,
                informative || quick_mode ? ""  // a quick run's figures are not measurements
                : met                     ? "met"
                                          : "MISSED");
    rows.push_back(
        {figure, measured.value, measured.unit, reference.label, reference.value, reference.unit, ratio, target, met});
}

}  // namespace bench
