// The figures of a benchmark's summary, written as JSON for bench/summary.py, which gathers every
// benchmark's into one table, a results file and plots. Written where GRADSYNC_BENCH_RESULTS
// names a directory (scripts/bench.sh sets it); nothing otherwise.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
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

// A figure a benchmark produced is a finite positive number; anything else means it broke.
inline bool sane(double figure) { return std::isfinite(figure) && figure > 0; }

// Writes `rows` to $GRADSYNC_BENCH_RESULTS/<name>.json, with the members of `extra` beside them.
// Figures that are not finite are written as null.
inline void write_summary_rows(const std::string& name, const std::vector<SummaryRow>& rows,
                               nlohmann::json extra = nlohmann::json::object()) {
    const char* dir = std::getenv("GRADSYNC_BENCH_RESULTS");
    if (dir == nullptr || *dir == '\0') return;
    nlohmann::json out = std::move(extra);
    out["source"] = name;
    out["rows"] = nlohmann::json::array();
    for (const auto& r : rows)
        out["rows"].push_back({{"figure", r.figure},
                               {"measured", r.measured},
                               {"unit", r.unit},
                               {"reference", r.reference},
                               {"reference_value", r.reference_value},
                               {"reference_unit", r.reference_unit.empty() ? r.unit : r.reference_unit},
                               {"ratio", r.ratio},
                               {"target", r.target},
                               {"met", r.met}});
    const std::string path = std::string(dir) + "/" + name + ".json";
    std::ofstream file(path);
    file << out.dump(1) << '\n';
    if (!file) {
        std::fprintf(stderr, "cannot write %s\n", path.c_str());
        std::exit(1);
    }
}

}  // namespace bench
