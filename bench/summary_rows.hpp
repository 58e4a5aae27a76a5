// The figures of a benchmark's summary, written as JSON for bench/summary.py, which gathers every
// benchmark's into one table, a results file and plots. Written where GRADSYNC_BENCH_RESULTS
// names a directory (scripts/bench.sh sets it); nothing otherwise.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace bench {

// One figure beside its same-run ceiling or baseline. target "-": shown for information.
struct SummaryRow {
    std::string figure;
    double measured = 0;
    std::string unit;
    std::string reference;  // what `reference_value` is
    double reference_value = 0;
    std::string reference_unit;  // where it differs from `unit`
    double ratio = 0;
    std::string target = "-";
    bool met = true;
};

namespace detail {
inline std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        if (static_cast<unsigned char>(c) >= 0x20) out += c;
    }
    return out + "\"";
}
inline std::string json_number(double v) {
    if (!std::isfinite(v)) return "null";
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", v);
    return buf;
}
}  // namespace detail

// Writes `rows` to $GRADSYNC_BENCH_RESULTS/<name>.json, with `extra` (a JSON object's members,
// or empty) beside them.
inline void write_summary_rows(const std::string& name, const std::vector<SummaryRow>& rows,
                               const std::string& extra = {}) {
    const char* dir = std::getenv("GRADSYNC_BENCH_RESULTS");
    if (dir == nullptr || *dir == '\0') return;
    const std::string path = std::string(dir) + "/" + name + ".json";
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) {
        std::fprintf(stderr, "cannot write %s\n", path.c_str());
        std::exit(1);
    }
    std::fprintf(f, "{\"source\": %s, \"rows\": [\n", detail::json_string(name).c_str());
    for (std::size_t i = 0; i < rows.size(); ++i) {
        const auto& r = rows[i];
        std::fprintf(f,
                     "  {\"figure\": %s, \"measured\": %s, \"unit\": %s, \"reference\": %s, "
                     "\"reference_value\": %s, \"reference_unit\": %s, \"ratio\": %s, \"target\": %s, "
                     "\"met\": %s}%s\n",
                     detail::json_string(r.figure).c_str(), detail::json_number(r.measured).c_str(),
                     detail::json_string(r.unit).c_str(), detail::json_string(r.reference).c_str(),
                     detail::json_number(r.reference_value).c_str(),
                     detail::json_string(r.reference_unit.empty() ? r.unit : r.reference_unit).c_str(),
                     detail::json_number(r.ratio).c_str(), detail::json_string(r.target).c_str(),
                     r.met ? "true" : "false", i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]%s%s}\n", extra.empty() ? "" : ", ", extra.c_str());
    std::fclose(f);
}

}  // namespace bench
