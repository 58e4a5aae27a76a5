// DataParallel<Model, Backend, Policies...>: wraps a model so that synchronize(), called after
// backward, leaves every rank holding the average of all ranks' gradients.
#pragma once

#include <gradsync/backend.hpp>
#include <gradsync/bucket.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/detail/layout_agreement.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/error.hpp>
#include <gradsync/memory.hpp>
#include <gradsync/model.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>  // for std::is_same_v
#include <vector>

namespace gradsync::inline v0 {

// Policies, in any order, each optional:
//   bucketer  SizeCappedBuckets (default), SingleBucket, PerParameterBuckets
//   packing   AutoPacking (default), PackedBuckets, InPlaceBuckets
//   memory    HostMemory (default)
template <class Model, class BackendT, class... Policies>
class DataParallel {
    static_assert(detail::check_model_access<Model>());
    static_assert(detail::check_backend<BackendT>());
    static_assert((detail::check_policy<Policies>() && ...));

public:
    using bucketer_type = detail::select_policy<policy_category::bucketer, SizeCappedBuckets, Policies...>;
    using packing_type = detail::select_policy<policy_category::packing, AutoPacking, Policies...>;
    using memory_type = detail::select_policy<policy_category::memory, HostMemory, Policies...>;
    static_assert(detail::check_bucketer<bucketer_type>());
    static_assert(!std::is_same_v<packing_type, InPlaceBuckets> || ScatteredAllreduce<BackendT>,
                  "gradsync: InPlaceBuckets needs a backend that reduces scattered segments "
                  "(the ScatteredAllreduce concept, e.g. LocalBackend); use PackedBuckets or AutoPacking");

    // True when gradients are reduced where they lie, with no bucket buffer and no copies.
    static constexpr bool reduces_in_place =
        std::is_same_v<packing_type, InPlaceBuckets> ||
        (std::is_same_v<packing_type, AutoPacking> && ScatteredAllreduce<BackendT>);

    // Lists the model's parameters, checks them on every rank, agrees on the layout with every
    // rank, and copies rank 0's parameter values to every rank. A problem on any rank throws the
    // same exception on every rank. Model and backend must outlive the DataParallel.
    DataParallel(Model& model, BackendT& backend, Policies... policies)
        : model_(model), backend_(backend), bucketer_(detail::policy_value<bucketer_type>(std::tuple(policies...))) {
        init();
    }
    DataParallel(Model& model, BackendT& backend) requires(sizeof...(Policies) > 0) : model_(model), backend_(backend) {
        init();
    }

    DataParallel(const DataParallel&) = delete;
    DataParallel& operator=(const DataParallel&) = delete;

    // Averages every parameter's gradient over all ranks. Call on every rank after backward.
    void synchronize() {
        ++steps_;
        if (backend_.size() == 1) return;  // the local gradient is already the average
        for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
            const auto& bucket = plan_.buckets[b];
            if constexpr (reduces_in_place) {
                backend_.allreduce(std::span<const Segment>(segments_[b]), bucket.dtype, ReduceOp::average);
            } else {
                std::byte* data = memory_type::data(buffers_[b]);
                memory_type::pack(data, segments_[b], bucket.dtype);
                backend_.allreduce(Buffer{data, bucket.count, bucket.dtype}, ReduceOp::average);
                memory_type::unpack(segments_[b], data, bucket.dtype);
            }
        }
    }

    // Copies rank 0's parameter values into every rank's parameters.
    void broadcast_parameters() {
        if (backend_.size() == 1) return;
        for (const auto& p : params_)
            backend_.broadcast(std::span(static_cast<std::byte*>(p.data), p.bytes().count()), 0);
    }

    [[nodiscard]] const BucketPlan& plan() const { return plan_; }
    // The parameters gradsync synchronizes: the model's, in registration order, without the
    // zero-sized ones. Bucket::parameters index into this list.
    [[nodiscard]] std::span<const Parameter> parameters() const { return params_; }
    [[nodiscard]] int rank() const { return backend_.rank(); }
    [[nodiscard]] int world_size() const { return backend_.size(); }
    [[nodiscard]] std::uint64_t steps() const { return steps_; }
    [[nodiscard]] Model& model() const { return model_; }
    [[nodiscard]] BackendT& backend() const { return backend_; }
    [[nodiscard]] Bytes gradient_bytes() const { return plan_.bytes(); }
    // Memory this object holds for synchronization beyond the model's own buffers.
    [[nodiscard]] Bytes extra_memory() const {
        Bytes total;
        for (const auto& b : buffers_) total += Bytes{b.size()};
        for (const auto& s : segments_) total += Bytes{s.capacity() * sizeof(Segment)};
        return total;
    }

private:
    void init() {
        for (auto& p : gradsync::parameters(model_)) {
            if (p.count != 0) params_.push_back(std::move(p));
        }
        std::string problem = detail::find_parameter_problem(std::span<const Parameter>(params_), backend_);
        if (problem.empty()) plan_ = bucketer_.plan(params_);
        if (backend_.size() == 1) {
            if (!problem.empty()) throw InvalidModel("gradsync: invalid model on rank 0: " + problem);
        } else {
            detail::agree_on_layout(backend_, std::span<const Parameter>(params_), plan_, problem);
        }
        broadcast_parameters();

        segments_.reserve(plan_.buckets.size());
        for (const auto& bucket : plan_.buckets) {
            std::vector<Segment> segs;
            segs.reserve(bucket.parameters.size());
            for (auto i : bucket.parameters) segs.push_back(Segment{params_[i].grad, params_[i].count});
            segments_.push_back(std::move(segs));
            if constexpr (!reduces_in_place) {
                if (backend_.size() > 1) buffers_.push_back(memory_type::allocate(bucket.bytes()));
            }
        }
    }

    Model& model_;
    BackendT& backend_;
    bucketer_type bucketer_{};
    std::vector<Parameter> params_;
    BucketPlan plan_;
    std::vector<std::vector<Segment>> segments_;          // per bucket, the gradients in bucket order
    std::vector<typename memory_type::Storage> buffers_;  // per bucket, when packing
    std::uint64_t steps_ = 0;
};

}  // namespace gradsync::inline v0
