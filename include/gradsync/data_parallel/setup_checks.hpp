// What a rank checks of its own set-up before the ranks agree on the layout: problems that would
// make its gradients wrong, found here so that every rank refuses alike (through the agreement)
// instead of failing later, or silently.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/data_parallel/bucket_slot.hpp>       // for first_gap
#include <gradsync/data_parallel/layout_agreement.hpp>  // for LocalProblem
#include <gradsync/data_parallel/options.hpp>
#include <gradsync/error.hpp>
#include <gradsync/memory/policy.hpp>
#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::sort
#include <cstdio>     // for std::snprintf
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

// Why device gradients cannot go without a device memory policy: unused parameters would be
// zeroed by the host, and a bucket whose gradients are not one contiguous stretch would be packed
// by it.
inline std::string device_gradients_problem(const BucketPlan& plan, std::span<const Parameter> params,
                                            const Options& options) {
    if (options.find_unused_parameters)
        return "find_unused_parameters zeroes unused gradients, which device gradients need a device memory "
               "policy for: pass gradsync::CudaMemory{stream} (memory/cuda.cuh)";
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
        auto indices = plan.buckets[b].parameters;
        std::sort(indices.begin(), indices.end());
        std::vector<Segment> segs;
        for (auto i : indices) segs.push_back(Segment{params[i].grad, params[i].count});
        if (const auto k = first_gap(segs, plan.buckets[b].dtype); k != 0)
            return "the gradients of bucket " + std::to_string(b) + " ('" + params[indices[k - 1]].name + "', '" +
                   params[indices[k]].name +
                   "') are not adjacent in memory, and without a device memory policy they cannot be packed: pass "
                   "gradsync::CudaMemory{stream} (memory/cuda.cuh), or give the model one gradient buffer in "
                   "registration order (gradsync::ContiguousParameters)";
    }
    return {};
}

// The memory policy's passes (packing, the finalize pass) and the backend's collectives must be
// ordered on one stream: a collective queued after another stream's packing would reduce what
// that stream has not written yet.
template <class B, class M>
std::string stream_problem(const B& backend, const M& memory) {
    if constexpr (StreamOrdered<B> && StreamMemory<M>) {
        const auto collectives = backend.compute_stream();
        const auto passes = memory.stream();
        if (!(collectives == passes)) {
            char text[160];
            std::snprintf(text, sizeof text, "the memory policy's stream (%p) is not the backend's compute stream (%p)",
                          static_cast<const void*>(passes), static_cast<const void*>(collectives));
            return std::string(text) +
                   ": the collectives would not wait for the gradients packed and scaled on the other. Give both the "
                   "stream backward runs on: CudaMemory{stream} and NcclOptions::compute_stream (or the backend's "
                   "set_compute_stream(stream)) before wrapping the model";
        }
    }
    return {};
}

// Options that need parameters in host memory.
inline std::string device_memory_problem(const Options& options, bool device_memory) {
    if (device_memory && options.check_replicas_every != Options::replica_check_auto &&
        options.check_replicas_every > 0)
        return "Options::check_replicas_every needs parameters in host memory; with device memory leave it at "
               "replica_check_auto";
    return {};
}

// Options::autotune_buckets = true where buckets cannot be tuned.
inline std::string autotune_problem(const Options& options, bool tunable_bucketer, bool host_timed) {
    if (!options.autotune_buckets.value_or(false)) return {};
    if (!tunable_bucketer)
        return "Options::autotune_buckets chooses bucket caps, and this bucketer has none: use "
               "gradsync::SizeCappedBuckets, or leave autotune_buckets off";
    if (!host_timed)
        return "Options::autotune_buckets times collectives on the host, and this set-up runs them on a device "
               "stream (device memory or a device backend): leave autotune_buckets off";
    return {};
}

// The first problem a rank finds with its own set-up, worded alike for every kind: thrown at once
// in a world of one, else handed to the agreement so that every rank refuses alike.
class SetupProblems {
public:
    explicit SetupProblems(int rank) : rank_(rank) {}
    void model(const std::string& what) { add(LocalProblem::Kind::model, what); }
    void configuration(const std::string& what) { add(LocalProblem::Kind::configuration, what); }
    [[nodiscard]] bool any() const { return first_.kind != LocalProblem::Kind::none; }
    [[nodiscard]] const LocalProblem& first() const { return first_; }
    void throw_first() const {
        if (first_.kind == LocalProblem::Kind::configuration) throw ConfigurationError(first_.what);
        if (first_.kind == LocalProblem::Kind::model) throw InvalidModel(first_.what);
    }

private:
    void add(LocalProblem::Kind kind, const std::string& what) {
        if (any() || what.empty()) return;
        first_ = {kind, std::string("gradsync: invalid ") +
                            (kind == LocalProblem::Kind::model ? "model" : "configuration") + " on rank " +
                            std::to_string(rank_) + ": " + what};
    }
    int rank_;
    LocalProblem first_;
};

// Device gradients under a host memory policy, asked for a pass the host would make over them.
inline std::string untouchable_gradients(int rank) {
    return rank_prefix(rank) +
           ": step(), loss scaling and clipping need the finalize pass over the gradients, which device gradients "
           "get from a device memory policy: pass gradsync::CudaMemory{stream} (memory/cuda.cuh), or call "
           "synchronize() and apply the optimizer (and any unscaling) yourself";
}

}  // namespace gradsync::inline v0::detail
