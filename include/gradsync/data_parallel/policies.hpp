// The policies of one DataParallel: one of each kind picked from its template arguments, in any
// order, each defaulted, and each checked against its kind's concept with an error that names
// what is missing; and what they imply together (whether gradients are reduced in place, whether
// they lie where the host must not touch them).
#pragma once

#include <gradsync/amp/compression.hpp>
#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/backend/concept_checks.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/bucketers.hpp>
#include <gradsync/bucket/tuning.hpp>
#include <gradsync/data_parallel/options.hpp>
#include <gradsync/data_parallel/step_metrics_log.hpp>  // for check_metrics_policy
#include <gradsync/detail/policy.hpp>
#include <gradsync/lr.hpp>
#include <gradsync/metrics/step_metrics.hpp>
#include <gradsync/memory/host.hpp>
#include <gradsync/memory/packing.hpp>
#include <gradsync/memory/policy.hpp>
#include <gradsync/model/buffers.hpp>
#include <gradsync/reduction/comm_hook.hpp>

#include <concepts>  // for std::convertible_to
#include <tuple>

namespace gradsync::inline v0::detail {

template <class P>
constexpr bool check_packing_policy() {
    static_assert(
        requires {
            { P::mode } -> std::convertible_to<PackingMode>;
        },
        "gradsync: a packing policy needs `static constexpr gradsync::PackingMode mode`");
    return true;
}

template <class BackendT, class... Policies>
struct PolicySet {
    static_assert((check_policy<Policies>() && ...));

    using bucketer = select_policy<policy_category::bucketer, SizeCappedBuckets, Policies...>;
    using packing = select_policy<policy_category::packing, AutoPacking, Policies...>;
    using memory = select_policy<policy_category::memory, HostMemory, Policies...>;
    using buffers = select_policy<policy_category::buffers, BroadcastBuffers, Policies...>;
    using loss_scaler = select_policy<policy_category::loss_scaler, NoLossScaling, Policies...>;
    using compression = select_policy<policy_category::compression, NoCompression, Policies...>;
    using lr_rule = select_policy<policy_category::lr_rule, NoLrRule, Policies...>;
    using comm_hook = select_policy<policy_category::comm_hook, NoCommHook, Policies...>;
    using metrics = select_policy<policy_category::metrics, NoMetrics, Policies...>;

    static_assert(check_bucketer<bucketer>() && check_packing_policy<packing>() && check_memory_policy<memory>() &&
                  check_buffer_policy<buffers>() && check_loss_scaler<loss_scaler>() &&
                  check_compression<compression>() && check_lr_rule<lr_rule>() && check_comm_hook<comm_hook>() &&
                  check_metrics_policy<metrics>());
    static_assert(!comm_hook::hooked || !compression::compresses,
                  "gradsync: a communication hook decides what travels on the wire itself; drop the compression "
                  "policy");
    static_assert(check_comm_hook_memory<comm_hook, BackendT, memory>());

    // Gradients reduced where they lie, with no bucket buffer and no copies.
    static constexpr bool in_place = packing::mode == PackingMode::in_place ||
                                     (packing::mode == PackingMode::automatic && ScatteredAllreduce<BackendT>);
    static_assert(check_scattered_allreduce_if<BackendT, packing::mode == PackingMode::in_place>());

    // Gradients on the device (a device backend) under a host memory policy: each bucket is
    // reduced where it lies, as one contiguous buffer, and DataParallel touches no gradient memory
    // itself; what would (packing, unscaling, measuring, clipping, zeroing unused parameters) is
    // refused with an error that names the device memory policy.
    static constexpr bool gradients_untouchable = DeviceBackend<BackendT> && !memory::on_device;
    static_assert(check_stream_ordered_if<BackendT, memory::on_device>());
    static_assert(!gradients_untouchable || !compression::compresses,
                  "gradsync: wire compression of device gradients needs a device memory policy: pass "
                  "gradsync::CudaMemory{stream} (memory/cuda.cuh), or use NoCompression");

    static constexpr bool has_lr_rule = LrRule<lr_rule>;

    // Collectives the host times (launch to completion): what bucket tuning measures.
    static constexpr bool host_timed = !DeviceBackend<BackendT> && !memory::on_device;
    static constexpr bool tunable = TunableBucketer<bucketer> && host_timed;
    // No bucket boundary can change a bit of the result: the backend sums in rank order and no
    // bucket is redone alone (a float16 wire sum that overflowed), and no hook sees buckets.
    static constexpr bool plan_free_result =
        RankOrderedSums<BackendT> && !compression::compresses && !comm_hook::hooked;
    // Whether the buckets are autotuned: as Options::autotune_buckets says or, unset, where tuning
    // is possible and cannot change the result (nor can the norm clipping scales by, summed
    // bucket by bucket).
    static bool autotunes(const Options& options) {
        return options.autotune_buckets.value_or(tunable && plan_free_result && options.clip_norm == 0);
    }

    // The value of the policy of type P among those given, or a default one.
    template <class P>
    static P value(const std::tuple<Policies...>& given) {
        return policy_value<P>(given);
    }
};

}  // namespace gradsync::inline v0::detail
