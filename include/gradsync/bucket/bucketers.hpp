// Bucketers: the policies that group parameters into buckets (fusion buffers, one allreduce
// each), and the Bucketer concept with its check. A plan is a deterministic function of the
// parameter layout and the policy.
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/detail/meta.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::find, std::find_if, std::reverse, std::stable_sort
#include <concepts>   // for std::same_as
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>  // for std::exchange, std::move
#include <vector>

namespace gradsync::inline v0 {

// A bucketer turns the parameter list (registration order) and the order in which their
// gradients are expected to become ready into a plan. An empty order means reverse registration
// order, the order backward usually finishes them. Zero-sized parameters belong to no bucket.
template <class B>
concept Bucketer = detail::has_settings<B> &&
    requires(const B& b, std::span<const Parameter> params, std::span<const std::size_t> order) {
    { b.plan(params, order) } -> std::same_as<BucketPlan>;
};

namespace detail {

// The readiness order to plan with: `order` checked to be a permutation of the indices, or the
// reverse registration order when it is empty.
inline std::vector<std::size_t> readiness_order(std::size_t n, std::span<const std::size_t> order) {
    std::vector<std::size_t> out;
    if (order.empty()) {
        for (std::size_t i = n; i-- > 0;) out.push_back(i);
        return out;
    }
    std::vector<bool> seen(n, false);
    for (auto i : order) {
        if (i >= n || seen[i])
            throw Error("gradsync: a bucket order must list each of the " + std::to_string(n) +
                        " parameter indices once; it has " + std::to_string(i) +
                        (i >= n ? ", out of range" : " twice"));
        seen[i] = true;
    }
    if (order.size() != n)
        throw Error("gradsync: a bucket order must list each of the " + std::to_string(n) +
                    " parameter indices once; it has " + std::to_string(order.size()));
    return {order.begin(), order.end()};
}

// Buckets are filled per dtype, so a mixed model gets buckets of one dtype each.
class BucketFiller {
public:
    BucketFiller(std::span<const Parameter> params, BucketPlan& out) : params_(params), out_(out) {}

    Bucket& open(DType t) {
        auto it = std::find_if(open_.begin(), open_.end(), [t](const Bucket& b) { return b.dtype == t; });
        if (it != open_.end()) return *it;
        open_.push_back(Bucket{t, {}, 0});
        return open_.back();
    }
    void add(Bucket& b, std::size_t index) {
        b.parameters.push_back(index);
        b.count += params_[index].count;
    }
    void close(Bucket& b) {
        if (b.parameters.empty()) return;
        out_.buckets.push_back(std::move(b));
        b = Bucket{out_.buckets.back().dtype, {}, 0};
    }
    // Buckets still open, in the order their dtype first appeared.
    void close_all() {
        for (auto& b : open_) close(b);
    }

private:
    std::span<const Parameter> params_;
    BucketPlan& out_;
    std::vector<Bucket> open_;
};

}  // namespace detail

// Size-capped buckets: parameters in readiness order (by default reverse registration order),
// each bucket closed before a parameter that would push it over `cap`, so a parameter larger than
// the cap gets a bucket of its own, and the first bucket capped at `first_cap` so communication
// starts early.
//
// `growing` (the default): buckets filled to the cap from the last one back, so that what is left
// lands in the first and sizes do not shrink along backward (but by a parameter's size). A
// bucket's allreduce then fits in the next bucket's backward wherever communication is no slower
// than compute, and only the last bucket is left exposed after backward. Filled forward, as
// PyTorch DDP fills them (`growing = false`, with its 25 MiB caps), a plan that ends with a
// smaller bucket exposes its largest one when they are as fast. The 8 MiB cap was chosen by
// measuring exposed communication on ResNet-50 and BERT-base (docs/performance.md).
struct SizeCappedBuckets {
    using policy_category = policy_category::bucketer;

    Bytes cap = Bytes{8ull << 20};
    Bytes first_cap = Bytes{1ull << 20};
    bool growing = true;

    [[nodiscard]] std::string settings() const {
        return "size-capped, cap " + to_string(cap) + ", first cap " + to_string(first_cap) +
               (growing ? ", growing along backward" : ", filled forward");
    }
    [[nodiscard]] std::string invalid() const {
        if (cap.count() != 0 && first_cap.count() != 0) return {};
        return "SizeCappedBuckets needs a cap and a first_cap above 0 bytes, got cap " + to_string(cap) +
               " and first_cap " + to_string(first_cap);
    }

    [[nodiscard]] BucketPlan plan(std::span<const Parameter> params, std::span<const std::size_t> order = {}) const {
        if (auto why = invalid(); !why.empty()) throw Error("gradsync: " + why);
        if (growing) return plan_growing(params, detail::readiness_order(params.size(), order));
        BucketPlan plan;
        detail::BucketFiller filler(params, plan);
        struct Limit {
            DType dtype;
            Bytes value;
        };
        std::vector<Limit> limits;  // per dtype: first_cap until its first bucket closes
        auto limit_of = [&](DType t) -> Bytes& {
            for (auto& l : limits)
                if (l.dtype == t) return l.value;
            limits.push_back({t, first_cap});
            return limits.back().value;
        };
        for (auto i : detail::readiness_order(params.size(), order)) {
            const auto& p = params[i];
            if (p.count == 0) continue;
            auto& bucket = filler.open(p.dtype);
            auto& limit = limit_of(p.dtype);
            if (!bucket.parameters.empty() && bucket.bytes() + p.bytes() > limit) {
                filler.close(bucket);
                limit = cap;
            }
            filler.add(bucket, i);
            if (bucket.bytes() >= limit) {
                filler.close(bucket);
                limit = cap;
            }
        }
        filler.close_all();
        return plan;
    }

private:
    [[nodiscard]] BucketPlan plan_growing(std::span<const Parameter> params,
                                          const std::vector<std::size_t>& ready) const {
        std::vector<std::size_t> position(params.size());
        for (std::size_t k = 0; k < ready.size(); ++k) position[ready[k]] = k;
        std::vector<DType> dtypes;
        for (auto i : ready)
            if (params[i].count != 0 && std::find(dtypes.begin(), dtypes.end(), params[i].dtype) == dtypes.end())
                dtypes.push_back(params[i].dtype);
        BucketPlan plan;
        for (const DType t : dtypes) {
            // From the last parameter of this dtype back: close a bucket before one that would
            // push it over the cap, so that what is left for the front is the smallest.
            std::vector<Bucket> backwards;
            Bucket open{t, {}, 0};
            for (auto k = ready.size(); k-- > 0;) {
                const auto& p = params[ready[k]];
                if (p.count == 0 || p.dtype != t) continue;
                if (!open.parameters.empty() && open.bytes() + p.bytes() > cap)
                    backwards.push_back(std::exchange(open, Bucket{t, {}, 0}));
                open.parameters.push_back(ready[k]);
                open.count += p.count;
            }
            if (!open.parameters.empty()) backwards.push_back(std::move(open));
            // The first bucket of the dtype (the rest of it, at the front) at most first_cap.
            if (!backwards.empty() && backwards.back().bytes() > first_cap && backwards.back().parameters.size() > 1) {
                Bucket& front = backwards.back();  // parameters in reverse readiness order
                Bucket first{t, {}, 0};
                while (front.parameters.size() > 1 &&
                       (first.parameters.empty() ||
                        first.bytes() + params[front.parameters.back()].bytes() <= first_cap)) {
                    first.count += params[front.parameters.back()].count;
                    front.count -= params[front.parameters.back()].count;
                    first.parameters.insert(first.parameters.begin(), front.parameters.back());
                    front.parameters.pop_back();
                }
                if (!first.parameters.empty()) backwards.push_back(std::move(first));
            }
            for (auto& b : backwards) {
                std::reverse(b.parameters.begin(), b.parameters.end());
                plan.buckets.push_back(std::move(b));
            }
        }
        // Launch order: as each bucket completes, the readiness of its last parameter.
        std::stable_sort(plan.buckets.begin(), plan.buckets.end(), [&](const Bucket& a, const Bucket& b) {
            return position[a.parameters.back()] < position[b.parameters.back()];
        });
        return plan;
    }
};

// One bucket per dtype holding every parameter: the fewest collectives, no overlap with backward.
struct SingleBucket {
    using policy_category = policy_category::bucketer;
    [[nodiscard]] std::string settings() const { return "single bucket"; }

    [[nodiscard]] BucketPlan plan(std::span<const Parameter> params, std::span<const std::size_t> order = {}) const {
        BucketPlan plan;
        detail::BucketFiller filler(params, plan);
        for (auto i : detail::readiness_order(params.size(), order)) {
            if (params[i].count != 0) filler.add(filler.open(params[i].dtype), i);
        }
        filler.close_all();
        return plan;
    }
};

// One bucket per parameter, in readiness order: no fusion at all.
struct PerParameterBuckets {
    using policy_category = policy_category::bucketer;
    [[nodiscard]] std::string settings() const { return "one bucket per parameter"; }

    [[nodiscard]] BucketPlan plan(std::span<const Parameter> params, std::span<const std::size_t> order = {}) const {
        BucketPlan plan;
        for (auto i : detail::readiness_order(params.size(), order)) {
            if (params[i].count != 0) plan.buckets.push_back(Bucket{params[i].dtype, {i}, params[i].count});
        }
        return plan;
    }
};

namespace detail {

template <class B>
constexpr bool check_bucketer() {
    static_assert(Bucketer<B>,
                  "gradsync: a bucketer policy needs a member `gradsync::BucketPlan plan(std::span<const "
                  "gradsync::Parameter> params, std::span<const std::size_t> order) const`");
    return true;
}

}  // namespace detail

}  // namespace gradsync::inline v0
