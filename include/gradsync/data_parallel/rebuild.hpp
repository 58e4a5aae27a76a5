// Bucket rebuild: after the first overlapped step, the plan made again in the order rank 0 saw
// gradients become ready (as PyTorch DDP does), so that buckets fill in the order backward
// really finishes them. Every rank plans with rank 0's order, so the plans agree.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/bucketers.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/model/model.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace gradsync::inline v0::detail {

// `arrived`: this rank's readiness order (parameters that never came through grad_ready keep
// their place, at the end, in reverse registration order).
template <Backend B, Bucketer P>
BucketPlan plan_in_readiness_order(B& backend, const P& bucketer, std::span<const Parameter> params,
                                   std::span<const std::size_t> arrived) {
    std::vector<std::uint64_t> order(arrived.begin(), arrived.end());
    std::vector<bool> seen(params.size(), false);
    for (auto p : arrived) seen[p] = true;
    for (std::size_t p = params.size(); p-- > 0;)
        if (!seen[p]) order.push_back(p);
    if (backend.size() > 1) backend.broadcast(std::as_writable_bytes(std::span<std::uint64_t>(order)), 0);
    return bucketer.plan(params, std::vector<std::size_t>(order.begin(), order.end()));
}

}  // namespace gradsync::inline v0::detail
