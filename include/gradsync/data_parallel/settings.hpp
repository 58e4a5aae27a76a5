// What every rank must agree on besides the layout: each setting that changes what is summed or
// how it is applied (the policies and the Options that change the arithmetic), as text, so that
// ranks that differ are told which setting differs, and how. And what is wrong with a setting on
// its own, found at construction rather than after the first step.
#pragma once

#include <gradsync/data_parallel/options.hpp>
#include <gradsync/detail/number_text.hpp>
#include <gradsync/detail/policy.hpp>

#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

struct Setting {
    std::string name;
    std::string value;
};

// A policy's settings() (every policy has one: detail::has_settings).
template <has_settings P>
std::string settings_of(const P& p) {
    return p.settings();
}

// What is wrong with a policy on its own (its invalid(), where it has one), or "".
template <class P>
std::string invalid_of(const P& p) {
    if constexpr (requires {
                      { p.invalid() } -> std::convertible_to<std::string>;
                  })
        return p.invalid();
    else
        return {};
}

// The settings that change the sums, in a fixed order.
template <class Bucketer, class Packing, class Memory, class Buffers, class Scaler, class Compression, class Lr,
          class Hook>
std::vector<Setting> agreed_settings(const Bucketer& bucketer, const Memory& memory, const Scaler& scaler, const Lr& lr,
                                     const Hook& hook, const Options& options, bool autotunes, bool device_backend,
                                     bool device_memory) {
    return {{"bucketer", settings_of(bucketer)},
            {"packing", settings_of(Packing{})},
            {"memory policy", settings_of(memory)},
            {"buffer policy", settings_of(Buffers{})},
            {"loss scaler", settings_of(scaler)},
            {"compression", settings_of(Compression{})},
            {"LR rule", settings_of(lr)},
            {"communication hook", settings_of(hook)},
            {"Options::find_unused_parameters", options.find_unused_parameters ? "true" : "false"},
            {"Options::rebuild_buckets", options.rebuild_buckets ? "true" : "false"},
            {"Options::autotune_buckets", autotunes ? "true" : "false"},
            {"Options::clip_norm", exact_text(options.clip_norm)},
            {"Options::check_histories", options.check_histories.value_or(!device_backend) ? "true" : "false"},
            {"Options::check_replicas_every", std::to_string(options.replica_check_interval(device_memory))}};
}

// The first thing wrong with the configuration, or "".
template <class... Policies>
std::string invalid_configuration(const Options& options, const Policies&... policies) {
    std::string why = options.invalid();
    ((why = why.empty() ? invalid_of(policies) : why), ...);
    return why;
}

}  // namespace gradsync::inline v0::detail
