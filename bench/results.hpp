// What the benchmark files share with bench_main.cpp: their registration functions, the quick
// mode, and the figures that are not timings (memory held), for the summary printed after the run.
#pragma once

#include <gradsync/bytes.hpp>

#include <string>

namespace bench {

void register_collectives();
void register_data_parallel();
void register_overlap();
void register_amp();
void register_gather_behind();
void register_metrics();

// --quick: every benchmark once and briefly, so that one that breaks or stops producing its
// figures shows at once (the tests run it); a quick run's figures mean nothing.
bool quick();
inline int repetitions_of(int full) { return quick() ? 1 : full; }
inline double min_seconds_of(double full) { return quick() ? 0.001 : full; }
inline int iterations_of(int full) { return quick() ? 2 : full; }

// Memory DataParallel and its backend hold beyond the model, beside the gradients' own bytes.
void record_memory(const std::string& key, gradsync::Bytes extra, gradsync::Bytes gradients);

}  // namespace bench
