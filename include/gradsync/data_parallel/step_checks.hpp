// What synchronize() checks as a step ends: that the ranks' collective histories agree (and the
// trainer's step numbers, where it passes them), and every Options::check_replicas_every steps
// that their replicas do.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/data_parallel/history.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/options.hpp>
#include <gradsync/data_parallel/replica_check.hpp>
#include <gradsync/data_parallel/step_number.hpp>
#include <gradsync/model/buffers.hpp>

#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace gradsync::inline v0::detail {

// The parameters and the buffers kept equal, compared with rank 0's. `when`: "step 100".
template <Backend B>
void check_replicas(B& backend, const ModelLayout& layout, BufferSync buffers, const std::string& when) {
    const auto tensors = replica_tensors(layout.params, layout.buffers, buffers);
    compare_replicas(backend, std::span<const ReplicaTensor>(tensors), when);
}

// The ranks' collective histories compared once per step, where `wanted` and the backend cannot
// compare them at each collective, and the trainer's step numbers where it passed one.
template <Backend B>
void check_histories(B& backend, const CollectiveHistory& history, bool wanted, std::int64_t step,
                     std::optional<StepNumber> number) {
    if ((wanted && !CheckedCollectives<B>) || number)
        history.verify(backend, step, number ? std::optional(number->value) : std::nullopt);
}

// Histories are compared where the Options ask for it (by default, unless the host would wait for
// a device stream).
template <Backend B>
void check_step_end(B& backend, const CollectiveHistory& history, const Options& options, bool device_memory,
                    const ModelLayout& layout, BufferSync buffers, std::int64_t step,
                    std::optional<StepNumber> number) {
    check_histories(backend, history, options.check_histories.value_or(!DeviceBackend<B>), step, number);
    const auto every = options.replica_check_interval(device_memory);
    if (every > 0 && static_cast<std::uint64_t>(step) % every == 0)
        check_replicas(backend, layout, buffers, "step " + std::to_string(step));
}

}  // namespace gradsync::inline v0::detail
