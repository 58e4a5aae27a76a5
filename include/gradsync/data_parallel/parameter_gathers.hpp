// The sharded front's all-gathers behind the next forward (ShardedOptions::gather_behind_forward):
// step() launches every bucket's all-gather in the order the forward reads the buckets (by their
// first parameter) and returns; each bucket is then waited for on its own, when the forward is
// about to read one of its parameters (param_ready), so that the forward computes while the later
// buckets are still gathered. Which buckets are still to be waited for is kept here, so that a
// forward that read a parameter without waiting is found, not trained on.
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/data_parallel/readiness.hpp>  // for ReadinessError
#include <gradsync/detail/deadline.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::sort, std::min
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0::detail {

// What the waits need of the front that owns them (once per bucket and step: no hot path).
struct GatherContext {
    std::function<std::string()> where;                      // rank and step, to begin messages
    std::function<std::string(std::size_t)> parameter_name;  // of parameter p
    std::function<std::uint64_t()> steps;                    // steps completed: the last launched them
    std::function<void(std::size_t)> unpack;  // after bucket b is waited for; empty where they lie in place
    std::chrono::milliseconds timeout{};
};

// What a rank whose forward read parameter `name` without waiting for it is told, where it was
// found (`found_at`: at step(), or as its gradient came).
inline std::string unwaited_parameter(const std::string& where, const std::string& name, const char* found_at) {
    return where + ": parameter '" + name + "' was not waited for before " + found_at +
           ": its all-gather from the last step (ShardedOptions::gather_behind_forward) may not have written it "
           "when the forward read it. Call param_ready(\"" +
           name + "\") before the forward reads a parameter, or wait_for_parameters() before the forward";
}

// A bucket's all-gather that did not complete by its deadline; `first`: its first parameter.
inline std::string late_gather(const std::string& where, std::size_t b, const std::string& first, std::uint64_t step,
                               std::chrono::milliseconds timeout) {
    return where + ": the all-gather of bucket " + std::to_string(b) + " (parameter '" + first +
           "', ...) launched by step " + std::to_string(step) + " did not complete within " +
           std::to_string(timeout.count()) + " ms; a rank may have stopped before it";
}

template <class Handle>
class ParameterGathers {
    using clock = std::chrono::steady_clock;

public:
    // The buckets of `plan` over `params` parameters. Between steps.
    void plan(const BucketPlan& plan, std::size_t params, GatherContext context) {
        context_ = std::move(context);
        const std::size_t buckets = plan.buckets.size();
        bucket_of_.assign(params, 0);
        std::vector<std::size_t> first(buckets, params);
        for (std::size_t b = 0; b < buckets; ++b)
            for (auto p : plan.buckets[b].parameters) {
                bucket_of_[p] = b;
                first[b] = std::min(first[b], p);
            }
        first_ = first;
        order_.resize(buckets);
        for (std::size_t b = 0; b < buckets; ++b) order_[b] = b;
        std::sort(order_.begin(), order_.end(), [&](std::size_t x, std::size_t y) { return first[x] < first[y]; });
        handles_.clear();
        handles_.resize(buckets);
    }

    // The buckets in the order the forward reads them: the order their all-gathers go in.
    [[nodiscard]] std::span<const std::size_t> order() const { return order_; }

    // Bucket b's all-gather is in flight (`handle`) and is to be waited for before the forward
    // reads its parameters.
    void launched(std::size_t b, Handle handle) { handles_[b].emplace(std::move(handle)); }
    [[nodiscard]] bool pending(std::size_t b) const { return handles_[b].has_value(); }
    // The first bucket, in forward order, still to be waited for.
    [[nodiscard]] std::optional<std::size_t> first_pending() const {
        for (auto b : order_)
            if (pending(b)) return b;
        return std::nullopt;
    }

    // Waits for the all-gather of the bucket that holds parameter p (ModelLayout::none: none), then
    // unpacks it; a TimeoutError past the timeout names the bucket.
    void wait_for_parameter(std::size_t p) {
        if (p < bucket_of_.size()) wait(bucket_of_[p], deadline_after(context_.timeout));
    }
    // ...for every bucket, in forward order, by one deadline.
    void wait_all() {
        const auto deadline = deadline_after(context_.timeout);
        for (auto b : order_) wait(b, deadline);
    }
    // Parameter p has a gradient, so the forward read it: its bucket must have been waited for.
    void check_read(std::size_t p) const {
        if (p < bucket_of_.size() && pending(bucket_of_[p])) throw unwaited(p, "its gradient came");
    }
    // At step(): every bucket must have been waited for (the forward read them all).
    void check_all_waited() const {
        if (const auto b = first_pending()) throw unwaited(first_[*b], "step()");
    }

    [[nodiscard]] bool in_flight() const { return first_pending().has_value(); }
    // After a failure: waits for the all-gathers in flight until `deadline`, ignoring their
    // errors (after an abort they end at once); the parameters are then unspecified.
    void drain(clock::time_point deadline) {
        for (auto& h : handles_) {
            try {
                if (h) (void)h->wait_until(deadline);
            } catch (...) {
            }
            h.reset();
        }
    }

private:
    void wait(std::size_t b, clock::time_point deadline) {
        if (!pending(b)) return;
        if (!handles_[b]->wait_until(deadline))
            throw TimeoutError(late_gather(context_.where(), b, context_.parameter_name(first_[b]), context_.steps(),
                                           context_.timeout));
        if (context_.unpack) context_.unpack(b);
        handles_[b].reset();
    }
    [[nodiscard]] ReadinessError unwaited(std::size_t p, const char* found_at) const {
        return ReadinessError(unwaited_parameter(context_.where(), context_.parameter_name(p), found_at));
    }

    GatherContext context_;
    std::vector<std::size_t> bucket_of_;
    std::vector<std::size_t> first_;
    std::vector<std::size_t> order_;
    std::vector<std::optional<Handle>> handles_;  // a bucket's, until it is waited for
};

}  // namespace gradsync::inline v0::detail
