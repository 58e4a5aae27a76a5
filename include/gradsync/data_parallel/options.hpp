// Options: the run-time settings of a DataParallel, passed like a policy (in any position after
// the backend), e.g. DataParallel dp(model, backend, gradsync::Options{.find_unused_parameters = true}).
#pragma once

#include <gradsync/detail/number_text.hpp>
#include <gradsync/detail/policy.hpp>

#include <chrono>
#include <cstdint>
#include <cmath>  // for std::isfinite
#include <optional>
#include <string>

namespace gradsync::inline v0 {

struct Options {
    using policy_category = policy_category::options;

    // Every wait of this DataParallel ends by then, with a diagnosis naming the late rank.
    std::chrono::milliseconds timeout = std::chrono::seconds(600);
    // Parameters without grad_ready by synchronize() count as a zero gradient on this rank. Off,
    // a missing grad_ready is an error naming the parameter, on every rank.
    bool find_unused_parameters = false;
    // After the first step with grad_ready calls, rebuild the buckets in the order gradients
    // became ready on rank 0 (as PyTorch DDP does).
    bool rebuild_buckets = false;
    // Over the first steps with grad_ready calls, measure when each gradient becomes ready and
    // what each bucket's collective takes, and choose the bucket caps (and the readiness order)
    // that leave the least communication after backward: every few steps, at most twice, the
    // same plan on every rank (docs/overlap.md). Needs SizeCappedBuckets and collectives the host
    // times (LocalBackend, MpiBackend); true elsewhere is an error. Unset: on wherever the plan
    // cannot change a bit of the result, i.e. the backend sums in rank order whatever the plan
    // (LocalBackend), there is no wire compression (an overflowed float16 bucket is redone
    // alone) and no clipping (the norm is summed bucket by bucket); off elsewhere, since with 3 or
    // more ranks a ring's rounding follows the plan and a plan chosen from timings differs from
    // run to run (and on resume).
    std::optional<bool> autotune_buckets{};
    // A Chrome trace (chrome://tracing, ui.perfetto.dev) of every bucket's ready, launched and
    // done moments, written when the DataParallel is destroyed. Empty: $GRADSYNC_TIMELINE, if set.
    // "{rank}" in the path is replaced by the rank; ranks of one process may share one file.
    std::string timeline{};
    // Above 0: after synchronize(), gradients whose global L2 norm exceeds it are scaled down to
    // it (PyTorch's clip_grad_norm_ with max_norm = clip_norm).
    double clip_norm = 0;
    // Once per synchronize(), with a backend that cannot compare the ranks' collectives as they
    // are issued (MpiBackend, NcclBackend), one small allreduce compares their histories, so that
    // ranks that launched different buckets fail instead of mixing gradients. Unset: on where the
    // host waits for the collectives anyway (MpiBackend), off on a device backend (NcclBackend),
    // where it would make the host wait for the whole communication stream once per step. true
    // turns it on there too (a debugging run), false off everywhere.
    std::optional<bool> check_histories{};
    // Every this many synchronized steps (and at every checkpoint save), every rank hashes its
    // parameters and the buffers kept equal, and the ranks compare the hashes (one allreduce of
    // 16 bytes per rank), so that replicas that drifted apart are named instead of training on.
    // replica_check_auto: every replica_check_default steps where parameters are in host
    // memory, off for device memory. 0: off.
    static constexpr std::uint64_t replica_check_auto = ~std::uint64_t{0};
    static constexpr std::uint64_t replica_check_default = 500;
    std::uint64_t check_replicas_every = replica_check_auto;
    // Gradient storage may move between steps (a framework that frees gradients and allocates new
    // ones in backward): before each bucket's collective the model is listed again and the bucket
    // follows its gradients (one listing per step; one per bucket launched during backward, through
    // what the model keeps for the step where it keeps something: model_traits::lister_for_step).
    // false: the storage stays where it was at construction, and nothing is listed.
    bool storage_may_move = true;

    // What is wrong with these settings, or "".
    [[nodiscard]] std::string invalid() const {
        if (timeout.count() <= 0)
            return "Options::timeout is " + std::to_string(timeout.count()) + " ms; it must be above 0";
        if (!(clip_norm >= 0) || !std::isfinite(clip_norm))
            return "Options::clip_norm is " + detail::exact_text(clip_norm) +
                   "; it must be finite and at least 0 (0: no clipping)";
        return {};
    }

    // Every how many steps the replicas are compared (0: never), resolved for the memory policy.
    [[nodiscard]] std::uint64_t replica_check_interval(bool device_memory) const {
        if (check_replicas_every != replica_check_auto) return check_replicas_every;
        return device_memory ? 0 : replica_check_default;
    }
};

}  // namespace gradsync::inline v0
