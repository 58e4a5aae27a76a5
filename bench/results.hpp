// What the benchmark files share with bench_main.cpp: their registration functions and the
// figures that are not timings (memory held), for the summary printed after the run.
#pragma once

#include <gradsync/bytes.hpp>

#include <string>

namespace bench {

void register_collectives();
void register_data_parallel();
void register_overlap();
void register_amp();

// Memory DataParallel and its backend hold beyond the model, beside the gradients' own bytes.
void record_memory(const std::string& key, gradsync::Bytes extra, gradsync::Bytes gradients);

}  // namespace bench
