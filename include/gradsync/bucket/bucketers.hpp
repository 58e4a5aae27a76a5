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

#include <algorithm>  // for std::find_if
#include <concepts>   // for std::same_as
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0 {

// A bucketer turns the parameter list (registration order) and the order in which their
// gradients are expected to become ready into a plan. An empty order means reverse registration
// order, the order backward usually finishes them. Zero-sized parameters belong to no bucket.
template <class B>
concept Bucketer = requires(const B& b, std::span<const Parameter> params, std::span<const std::size_t> order) {
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

// Size-capped buckets, as PyTorch DDP builds them: parameters in readiness order (by default
// reverse registration order), the first bucket capped at `first_cap` so communication
// starts early, the rest at `cap`. A bucket is closed before a parameter that would push it over
// its cap, so a parameter larger than the cap gets a bucket of its own.
struct SizeCappedBuckets {
    using policy_category = policy_category::bucketer;

    Bytes cap = Bytes{25ull << 20};
    Bytes first_cap = Bytes{1ull << 20};

    [[nodiscard]] std::string settings() const {
        return "size-capped, cap " + to_string(cap) + ", first cap " + to_string(first_cap);
    }
    [[nodiscard]] std::string invalid() const {
        if (cap.count() != 0 && first_cap.count() != 0) return {};
        return "SizeCappedBuckets needs a cap and a first_cap above 0 bytes, got cap " + to_string(cap) +
               " and first_cap " + to_string(first_cap);
    }

    [[nodiscard]] BucketPlan plan(std::span<const Parameter> params, std::span<const std::size_t> order = {}) const {
        if (auto why = invalid(); !why.empty()) throw Error("gradsync: " + why);
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
