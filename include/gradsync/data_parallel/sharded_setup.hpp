// What a ShardedDataParallel checks of its own set-up before the ranks agree, and the settings
// they agree on: the same problem wording and agreement as DataParallel's (setup_checks.hpp).
#pragma once

#include <gradsync/backend/concept_checks.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/settings.hpp>
#include <gradsync/data_parallel/setup_checks.hpp>
#include <gradsync/data_parallel/sharded_options.hpp>
#include <gradsync/detail/number_text.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/reduction/comm_hook.hpp>

#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

// The sharding collectives, with their readable errors; shards where the backend's collectives
// take them (a device backend: device memory, its collectives ordered after the memory policy's
// stream); communication hooks where their values may lie.
template <class B, class Memory, class Hook>
constexpr bool check_sharded_backend() {
    static_assert(check_sharded_collectives<B>());
    static_assert(!DeviceBackend<B> || Memory::on_device,
                  "gradsync: ShardedDataParallel over a backend whose collectives take device memory (NcclBackend, "
                  "CudaLocalBackend) keeps its shards on the device: give it gradsync::CudaMemory{stream} "
                  "(memory/cuda.cuh) with the stream backward runs on");
    static_assert(check_stream_ordered_if<B, Memory::on_device>());
    static_assert(check_comm_hook_memory<Hook, B, Memory>());
    return true;
}

// `releasable`: the model can release gradients (stage 2 needs it, and no communication hook:
// `hooked`).
template <class Bucketer, class Scaler>
SetupProblems sharded_setup_problems(int rank, const ModelLayout& layout, const ShardedOptions& options,
                                     const Bucketer& bucketer, const Scaler& scaler, bool releasable, bool hooked,
                                     bool stream_ordered) {
    SetupProblems problems(rank);
    for (const auto& p : layout.params)
        if (p.dtype != DType::float32)
            problems.configuration("ShardedDataParallel steps float32 parameters only; '" + p.name + "' is " +
                                   to_string(p.dtype));
    problems.model(no_parameters_problem(layout.params, layout.param_of_model_index.size()));
    if (!(options.clip_norm >= 0))
        problems.configuration("ShardedOptions::clip_norm must be at least 0, got " + exact_text(options.clip_norm));
    problems.configuration(invalid_of(bucketer));
    problems.configuration(invalid_of(scaler));
    if (options.release_gradients && !releasable)
        problems.configuration(
            "ShardedOptions::release_gradients needs a model that can release gradients: give it a member "
            "release_gradients(std::span<const std::size_t>), or see docs/sharding.md");
    else if (options.release_gradients && hooked)
        problems.configuration(
            "ShardedOptions::release_gradients keeps each bucket's share as soon as it is reduced, and a "
            "communication hook finishes its buckets only at step(): use one or the other");
    if (options.gather_behind_forward && stream_ordered)
        problems.configuration(
            "ShardedOptions::gather_behind_forward needs a host backend (LocalBackend, MpiBackend): on a device "
            "stream the all-gathers are already queued behind the optimizer and ahead of the next forward");
    return problems;
}

template <class Bucketer, class Scaler, class Buffers, class Memory, class Hook>
std::vector<Setting> sharded_settings(const ShardedOptions& options, const Bucketer& bucketer, const Scaler& scaler,
                                      const Buffers& buffers, const Memory& memory, const Hook& hook) {
    return {{"bucketer", settings_of(bucketer)},
            {"buffer policy", settings_of(buffers)},
            {"memory policy", settings_of(memory)},
            {"loss scaler", settings_of(scaler)},
            {"communication hook", settings_of(hook)},
            {"ShardedOptions::release_gradients", options.release_gradients ? "true" : "false"},
            {"ShardedOptions::clip_norm", exact_text(options.clip_norm)},
            {"ShardedOptions::check_histories", options.check_histories ? "true" : "false"},
            {"ShardedOptions::gather_behind_forward", options.gather_behind_forward ? "true" : "false"}};
}

}  // namespace gradsync::inline v0::detail
