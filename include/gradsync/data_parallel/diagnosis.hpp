// Diagnosis: what to say when a deadline passes. For this rank, which bucket was late, and which
// ranks are behind (from their collective counts, where the backend can tell); for a peer that
// asks, where this rank stands: in backward waiting for which gradients, or in synchronize().
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/group_label.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/readiness.hpp>
#include <gradsync/error.hpp>
#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::max
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>  // for std::forward
#include <vector>

namespace gradsync::inline v0::detail {

// Up to `most` of the named parameters, quoted: "'a', 'b', ...".
inline std::string quoted_names(std::span<const std::size_t> indices, std::span<const Parameter> params,
                                std::size_t most) {
    std::string out;
    for (std::size_t k = 0; k < indices.size() && k < most; ++k)
        out += (k ? ", '" : "'") + params[indices[k]].name + "'";
    if (indices.size() > most) out += ", ...";
    return out;
}

// "gradsync: rank 0, step 7: bucket 3 of 6 (1.0 MiB, 4 parameters: 'a', ...) was not reduced
// within 600000 ms. Behind the furthest rank (9): rank 2 has entered 8 collectives; rank 2: ..."
template <Backend B>
std::string diagnose_timeout(const B& backend, std::int64_t step, const BucketPlan& plan,
                             std::span<const Parameter> params, std::size_t b, std::chrono::milliseconds timeout) {
    const auto& bucket = plan.buckets[b];
    std::string msg = who(backend) + ", step " + std::to_string(step) + ": bucket " + std::to_string(b) + " of " +
                      std::to_string(plan.buckets.size()) + " (" + to_string(bucket.bytes()) + ", " +
                      std::to_string(bucket.parameters.size()) +
                      " parameters: " + quoted_names(bucket.parameters, params, 4) + ") was not reduced within " +
                      std::to_string(timeout.count()) + " ms";
    if constexpr (PeerStatus<B>) {
        // The ranks that entered fewer collectives than the furthest are the ones holding it up.
        const int world = backend.size();
        std::uint64_t furthest = 0;
        for (int r = 0; r < world; ++r) furthest = std::max(furthest, backend.peer_collectives(r));
        std::string behind;
        for (int r = 0; r < world; ++r) {
            const auto entered = backend.peer_collectives(r);
            if (entered < furthest)
                behind += (behind.empty() ? "" : ", ") + ("rank " + std::to_string(r)) + " has entered " +
                          std::to_string(entered) + " collectives";
        }
        if (!behind.empty()) msg += ". Behind the furthest rank (" + std::to_string(furthest) + "): " + behind;
        for (int r = 0; r < world; ++r) {
            const auto status = backend.peer_status(r);
            if (!status.empty())
                msg += "; rank " + std::to_string(r) + (r == backend.rank() ? " (this rank)" : "") + ": " + status;
        }
    } else if constexpr (AsksPeers<B>) {
        if (const auto peers = backend.where_peers_stand(); !peers.empty()) msg += "." + peers;
    }
    return msg;
}

// Where this rank stands, for a peer's diagnosis: runs on the peer's thread, and reads only the
// readiness atomics (and the plan, under the caller's lock against a rebuild).
inline std::string describe_rank(const Readiness& readiness, std::int64_t step, const BucketPlan& plan,
                                 std::span<const Parameter> params) {
    const auto at = std::to_string(step);
    if (readiness.accumulating()) return "accumulating under no_sync() before step " + at;
    switch (readiness.phase()) {
        case Readiness::Phase::idle: return "in step " + at + ", before any grad_ready() or synchronize()";
        case Readiness::Phase::synchronizing: return "in synchronize() of step " + at;
        case Readiness::Phase::backward: break;
    }
    const auto launched = readiness.launched();
    std::string out = "in the backward of step " + at + ", " + std::to_string(launched) + " of " +
                      std::to_string(plan.buckets.size()) + " buckets launched";
    if (launched < plan.buckets.size()) {
        const auto& bucket = plan.buckets[launched];
        std::vector<std::size_t> missing;
        for (auto p : bucket.parameters)
            if (!readiness.ready(p)) missing.push_back(p);
        out += "; bucket " + std::to_string(launched) + " waits for grad_ready of " + quoted_names(missing, params, 6) +
               " (" + std::to_string(missing.size()) + " of " + std::to_string(bucket.parameters.size()) +
               " parameters)";
    }
    return out;
}

// synchronize() found no grad_ready for these parameters: "'a' (bucket 2), 'b' (bucket 0) ...".
inline std::string missing_gradients(std::span<const std::size_t> missing, std::span<const Parameter> params,
                                     const Readiness& readiness) {
    std::string names;
    for (std::size_t k = 0; k < missing.size() && k < 8; ++k)
        names += (k ? ", '" : "'") + params[missing[k]].name + "' (bucket " +
                 std::to_string(readiness.bucket_of(missing[k])) + ")";
    if (missing.size() > 8) names += " and " + std::to_string(missing.size() - 8) + " more";
    return "synchronize() found no grad_ready for " + std::to_string(missing.size()) + " parameter" +
           (missing.size() == 1 ? "" : "s") + ": " + names +
           ". Call grad_ready for every parameter backward produced a gradient for, or pass "
           "gradsync::Options{.find_unused_parameters = true} to count the others as zero";
}

// What a DataParallel set up, for the log: "DataParallel: 4 parameters, 0 buffers, world size 4, ..."
inline std::string describe_setup(const ModelLayout& layout, int world, bool in_place, DType wire,
                                  std::size_t view_buckets, const BucketPlan& plan) {
    return "DataParallel: " + std::to_string(layout.params.size()) + " parameters, " +
           std::to_string(layout.buffers.size()) + " buffers, world size " + std::to_string(world) + ", " +
           (in_place ? "reduced in place" : "packed") + ", wire " + to_string(wire) + ", " +
           std::to_string(view_buckets) + " view buckets; bucket plan: " + to_string(plan);
}

// A reporter left with a backend that quotes it when a collective is late (StatusReporting),
// for as long as this lives; with other backends, nothing.
template <Backend B>
class StatusRegistration {
public:
    StatusRegistration() = default;
    StatusRegistration(const StatusRegistration&) = delete;
    StatusRegistration& operator=(const StatusRegistration&) = delete;
    ~StatusRegistration() {
        if constexpr (StatusReporting<B>)
            if (backend_ != nullptr) backend_->remove_status_reporter(id_);
    }

    template <class Report>
    void start(B& backend, Report&& report) {
        if constexpr (StatusReporting<B>) {
            id_ = backend.add_status_reporter(std::forward<Report>(report));
            backend_ = &backend;
        }
    }

private:
    B* backend_ = nullptr;
    std::uint64_t id_ = 0;
};

}  // namespace gradsync::inline v0::detail
