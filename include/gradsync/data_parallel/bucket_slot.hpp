// BucketSlot: one bucket's storage in the bucket engine and the state of its collective in the
// current step, and the routes a bucket travels by.
#pragma once

#include <gradsync/buffer.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/reduction/comm_hook.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace gradsync::inline v0::detail {

// The first k whose segment does not start where segment k - 1 ends; 0 when they all follow each
// other in memory.
inline std::size_t first_gap(std::span<const Segment> segs, DType t) {
    const std::size_t elem = size_of(t);
    for (std::size_t k = 1; k < segs.size(); ++k)
        if (static_cast<const std::byte*>(segs[k - 1].data) + segs[k - 1].count * elem != segs[k].data) return k;
    return 0;
}

// How a bucket travels.
enum class Route : std::uint8_t { in_place, view, packed, compressed, hook };

// Memory: the memory policy (its Table and Storage); Handle: the backend's asynchronous allreduce.
template <class Memory, class Handle>
struct BucketSlot {
    using clock = std::chrono::steady_clock;
    std::vector<Segment> segments;     // its gradients, by parameter index
    std::vector<std::size_t> indices;  // their parameters
    std::optional<Segment> view;       // set when they lie contiguously
    Route route = Route::in_place;
    DType dtype = DType::float32;          // the gradients'
    DType wire = DType::float32;           // what the collective moves
    std::size_t count = 0;                 // elements
    typename Memory::Table table;          // the segments, as the memory policy's passes take them
    bool measured = false;                 // finalized this step: its result slot is current
    typename Memory::Storage buffer;       // packed or compressed (world > 1), or a hook's float32 copy
    typename Memory::Storage widened;      // a float32 copy, made once when a compressed sum overflowed
    typename Memory::Table float32_table;  // a hook's float32 copy of 16-bit gradients (the buffer)
    std::optional<Handle> handle;
    std::optional<HookComm::Pending> pending;  // the hook's collectives in flight
    std::vector<HookParameter> hooked;         // the parameters, as the hook sees them
    std::int64_t hook_step = 0;                // the step the hook started in
    clock::time_point launched_at, finished_at;
};

}  // namespace gradsync::inline v0::detail
