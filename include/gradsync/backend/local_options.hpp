// The options of a LocalBackend group: which algorithm reduces, the one-shot size limit, and the
// deadline of every wait inside a collective.
#pragma once

#include <gradsync/version.hpp>

#include <gradsync/bytes.hpp>

#include <chrono>
#include <cstdint>

namespace gradsync::inline v0 {

// How a LocalBackend group reduces. Both algorithms sum in rank order, so they give bitwise
// identical results and `automatic` may switch between them by size without changing numbers.
enum class LocalAlgorithm : std::uint8_t {
    // one_shot for messages up to LocalGroupOptions::one_shot_max, reduce_scatter_all_gather above.
    automatic,
    // Latency-optimal: every rank copies its input to a staging slot, one barrier, and every rank
    // sums all slots into its own buffer. One synchronization; each rank reads n times the bytes.
    one_shot,
    // Bandwidth-optimal: rank r owns 1/n of the elements, sums them from every rank's buffer and
    // writes the result straight into every rank's buffer (reduce-scatter and all-gather fused,
    // which shared memory allows): each rank reads and writes each of its bytes once.
    reduce_scatter_all_gather,
};

struct LocalGroupOptions {
    LocalAlgorithm algorithm = LocalAlgorithm::automatic;
    // Size of each rank's one-shot staging slot; `automatic` uses one-shot at or below it.
    // On 2 ranks of a 2-core machine one-shot wins up to about 3 KiB (bench: allreduce latency).
    Bytes one_shot_max = Bytes{2u << 10};
    // Every wait inside a collective ends by then: a rank that does not arrive fails the group.
    std::chrono::milliseconds timeout = std::chrono::seconds(600);
};

}  // namespace gradsync::inline v0
