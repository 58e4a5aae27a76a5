// StepNumber: the trainer's own step number, passed to synchronize() or step(), so that ranks
// whose loops got out of step (one skipped or repeated an iteration) are caught at that very
// step rather than training on with mismatched batches: dp.step(optimizer, gradsync::StepNumber{i}).
#pragma once

#include <gradsync/version.hpp>

#include <cstdint>

namespace gradsync::inline v0 {

struct StepNumber {
    std::uint64_t value = 0;
};

}  // namespace gradsync::inline v0
