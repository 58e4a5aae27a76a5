// What a DataParallel does before its first step: check this rank's set-up (configuration, model,
// device memory, streams), plan the buckets, and agree with every rank on the layout, the plan and
// every setting that changes the sums. A problem on any rank throws the same exception on every
// rank, before anything was broadcast.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/bucket/tuning.hpp>
#include <gradsync/data_parallel/layout_agreement.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/options.hpp>
#include <gradsync/data_parallel/settings.hpp>
#include <gradsync/data_parallel/setup_checks.hpp>

#include <cstddef>
#include <span>
#include <string>

namespace gradsync::inline v0::detail {

// `Set` is the DataParallel's PolicySet; `memory` its memory policy object; `metrics_problem` what
// keeps the metrics policy from working here ("" if nothing). Returns the plan.
template <class Set, class BackendT>
BucketPlan check_and_agree(BackendT& backend, const ModelLayout& layout, const typename Set::bucketer& bucketer,
                           const Options& options, const typename Set::loss_scaler& scaler,
                           const typename Set::lr_rule& lr, const typename Set::memory& memory,
                           const typename Set::comm_hook& hook, const std::string& metrics_problem) {
    using memory_type = typename Set::memory;
    SetupProblems problems(backend.rank());
    problems.configuration(invalid_configuration(options, bucketer, scaler, lr));
    problems.configuration(metrics_problem);
    // Gradients may come later when storage is followed; not device gradients, which are checked
    // for contiguity now.
    const bool gradients_later = options.storage_may_move && !memory_type::on_device;
    problems.model(no_parameters_problem(layout.params, layout.param_of_model_index.size()));
    problems.model(find_model_problem(layout.params, layout.buffers, backend, gradients_later));
    BucketPlan plan;
    if (!problems.any()) plan = bucketer.plan(layout.params, std::span<const std::size_t>{});
    if (!problems.any() && Set::gradients_untouchable)
        problems.model(device_gradients_problem(plan, layout.params, options));
    problems.configuration(stream_problem(backend, memory));
    problems.configuration(device_memory_problem(options, memory_type::on_device));
    problems.configuration(autotune_problem(options, TunableBucketer<typename Set::bucketer>, Set::host_timed));
    if (backend.size() == 1) problems.throw_first();
    if (backend.size() > 1)
        agree_on_layout(backend, layout.params, layout.buffers, plan,
                        agreed_settings<typename Set::bucketer, typename Set::packing, memory_type,
                                        typename Set::buffers, typename Set::loss_scaler, typename Set::compression,
                                        typename Set::lr_rule, typename Set::comm_hook>(
                            bucketer, memory, scaler, lr, hook, options, Set::autotunes(options),
                            DeviceBackend<BackendT>, memory_type::on_device),
                        problems.first());
    return plan;
}

}  // namespace gradsync::inline v0::detail
