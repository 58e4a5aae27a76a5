// What a checkpoint asks of the front it saves or loads: whether it has state split across the
// ranks (ShardedDataParallel), whether its memory policy keeps the tensors on the device,
// whether the host can read them at all, and whether a checkpoint knows its layout.
#pragma once

#include <gradsync/backend/concepts.hpp>

#include <type_traits>  // for std::remove_cvref_t
#include <utility>      // for std::declval

namespace gradsync::inline v0::detail {

template <class DP>
constexpr bool sharded_front = requires(DP& d) {
    d.shard_pieces();
};

template <class DP>
constexpr bool on_device() {
    if constexpr (requires { DP::memory_type::on_device; })
        return DP::memory_type::on_device;
    else
        return false;
}

// Over a backend whose collectives take device memory the tensors lie there, and only a memory
// policy on the device copies them to the host.
template <class DP>
constexpr bool tensors_readable() {
    using B = std::remove_cvref_t<decltype(std::declval<DP&>().backend())>;
    static_assert(!DeviceBackend<B> || on_device<DP>(),
                  "gradsync: a Checkpoint of a front over a backend whose collectives take device memory "
                  "(NcclBackend, CudaLocalBackend) copies its tensors to the host through the memory policy: "
                  "give the front gradsync::CudaMemory{stream} (memory/cuda.cuh)");
    return true;
}

// A sharded front whose shards are replicated across nodes (ShardedDataParallel over
// TwoLevelBackend) has no checkpoint layout: refused where the checkpoint is written or read.
template <class DP>
constexpr bool checkpoint_layout_known() {
    using B = std::remove_cvref_t<decltype(std::declval<DP&>().backend())>;
    static_assert(!(sharded_front<DP> && ReplicatedShards<B>),
                  "gradsync: a Checkpoint cannot save or load a ShardedDataParallel whose shards are replicated "
                  "across nodes (over TwoLevelBackend); sharded over the whole job (a flat backend such as "
                  "MpiBackend) it can");
    return true;
}

}  // namespace gradsync::inline v0::detail
