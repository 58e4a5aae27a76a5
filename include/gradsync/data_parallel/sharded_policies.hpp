// The policies of one ShardedDataParallel, with DataParallel's grammar: one of each kind it takes
// (bucketer, loss scaler, buffer policy, communication hook, memory policy, metrics, ShardedOptions)
// picked from its template arguments, in any order, each defaulted and checked against its kind's concept; a policy of
// a kind it does not take is a clear error, not ignored.
#pragma once

#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/bucket/bucketers.hpp>
#include <gradsync/data_parallel/options.hpp>
#include <gradsync/data_parallel/sharded_options.hpp>
#include <gradsync/data_parallel/step_metrics_log.hpp>  // for check_metrics_policy
#include <gradsync/detail/policy.hpp>
#include <gradsync/memory/host.hpp>
#include <gradsync/memory/policy.hpp>
#include <gradsync/model/buffers.hpp>
#include <gradsync/reduction/comm_hook.hpp>

#include <tuple>
#include <type_traits>

namespace gradsync::inline v0::detail {

template <class P>
constexpr bool takes_sharded_category() {
    using C = typename category_of<P>::type;
    return std::is_same_v<C, policy_category::bucketer> || std::is_same_v<C, policy_category::loss_scaler> ||
           std::is_same_v<C, policy_category::buffers> || std::is_same_v<C, policy_category::comm_hook> ||
           std::is_same_v<C, policy_category::memory> || std::is_same_v<C, policy_category::options> ||
           std::is_same_v<C, policy_category::metrics>;
}

template <class P>
constexpr bool check_sharded_policy() {
    if constexpr (is_policy<P>) {
        static_assert(takes_sharded_category<P>(),
                      "gradsync: ShardedDataParallel takes a bucketer, a loss scaler, a buffer policy, a "
                      "communication hook, a memory policy, a metrics policy and gradsync::ShardedOptions; this "
                      "policy's kind "
                      "(packing, compression or LR rule) is DataParallel's only");
        static_assert(!std::is_same_v<P, Options>,
                      "gradsync: ShardedDataParallel's run-time settings are gradsync::ShardedOptions, not "
                      "gradsync::Options");
    }
    return true;
}

template <class... Policies>
struct ShardedPolicySet {
    static_assert((check_policy<Policies>() && ...));
    static_assert((check_sharded_policy<Policies>() && ...));

    using bucketer = select_policy<policy_category::bucketer, SizeCappedBuckets, Policies...>;
    using loss_scaler = select_policy<policy_category::loss_scaler, NoLossScaling, Policies...>;
    using buffers = select_policy<policy_category::buffers, BroadcastBuffers, Policies...>;
    using options = select_policy<policy_category::options, ShardedOptions, Policies...>;
    using comm_hook = select_policy<policy_category::comm_hook, NoCommHook, Policies...>;
    using memory = select_policy<policy_category::memory, HostMemory, Policies...>;
    using metrics = select_policy<policy_category::metrics, NoMetrics, Policies...>;
    static_assert(check_bucketer<bucketer>() && check_loss_scaler<loss_scaler>() && check_buffer_policy<buffers>() &&
                  check_comm_hook<comm_hook>() && check_memory_policy<memory>() && check_metrics_policy<metrics>());

    // The value of the policy of type P among those given, or a default one.
    template <class P>
    static P value(const std::tuple<Policies...>& given) {
        return policy_value<P>(given);
    }
};

}  // namespace gradsync::inline v0::detail
