// ShardedCore: what ShardedDataParallel derives from, the reduce-scatter half of the sharded
// step. Over FrontCore (front_core.hpp) with a bucket engine that reduce-scatters each bucket in
// float32 through the memory policy (host or device memory), where the gradients lie when the
// backend takes scattered memory (ScatteredShardedCollectives), else packed. It owns the plan,
// this rank's shard layout and stage 2's kept shares (released_shards.hpp), and takes each bucket
// from its launch to its share kept: during backward (launch(b), from grad_ready) or in step()
// (reduce_rest()). The front adds the decision, the optimizer and the all-gather.
#pragma once

#include <gradsync/backend/concept_checks.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/data_parallel/bucket_engine.hpp>
#include <gradsync/data_parallel/front_core.hpp>
#include <gradsync/data_parallel/released_shards.hpp>
#include <gradsync/data_parallel/shard_layout.hpp>
#include <gradsync/data_parallel/sharded_options.hpp>
#include <gradsync/data_parallel/sharded_policies.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/dtype.hpp>

#include <cstddef>
#include <span>

namespace gradsync::inline v0::detail {

// FrontCore with a bucket engine that reduce-scatters in float32.
template <class Front, class Model, class BackendT, class Set>
using ShardedFrontCore =
    FrontCore<Front, Model, BackendT,
              BucketEngine<BackendT, typename Set::memory, DType::float32, ScatteredShardedCollectives<BackendT>,
                           typename Set::comm_hook, BucketCollective::reduce_scatter>,
              ShardedOptions, typename Set::loss_scaler, typename Set::metrics>;

template <class Front, class Model, class BackendT, class Set>
class ShardedCore : public ShardedFrontCore<Front, Model, BackendT, Set> {
protected:
    using Base = ShardedFrontCore<Front, Model, BackendT, Set>;

private:
    friend Base;                          // calls launch() and end_step()
    using Memory = typename Set::memory;  // the gradients', the shards' and the buckets'

public:
    // Whether shards are reduced and gathered where they lie (ScatteredShardedCollectives).
    static constexpr bool in_place = ScatteredShardedCollectives<BackendT>;

    // Buckets whose reduce_scatter grad_ready has started in this step (during backward).
    [[nodiscard]] std::size_t buckets_launched() const { return this->readiness_.launched(); }
    // Elements of this rank's shards: the length of each optimizer state array it keeps.
    [[nodiscard]] std::size_t state_elements() const { return shards_.state_elements; }
    // Elements of every parameter, for comparison: what an unsharded optimizer keeps per array.
    [[nodiscard]] std::size_t parameter_elements() const { return plan_.bytes().count() / sizeof(float); }
    [[nodiscard]] const BucketPlan& plan() const { return plan_; }
    // This rank's pieces, as step() hands them to the optimizer (the state is the trainer's).
    [[nodiscard]] std::span<const ShardPiece<float>> shard_pieces() const { return shards_.pieces; }
    // The ranks the state is split among and this rank's place among them: every rank of the
    // backend, or over a backend that replicates its shards (TwoLevelBackend) this rank's node.
    [[nodiscard]] int shard_ranks() const { return detail::shard_ranks(this->backend_); }
    [[nodiscard]] int shard_rank() const { return detail::shard_rank(this->backend_); }
    // Memory held beyond the model's: where the backend cannot reduce scattered memory, packed
    // buffers for the parameters (one per bucket) and the gradients (one per bucket, or with
    // release_gradients three of the largest bucket's size, lent in turn); with release_gradients
    // this rank's share of the averaged gradients; the engine's bookkeeping.
    [[nodiscard]] Bytes extra_memory() const {
        return this->engine_.memory_held() +
               Bytes{released_.bytes() + (in_place ? 0 : parameter_elements() * sizeof(float))};
    }

protected:
    using Base::Base;
    using Shards = ShardLayout<in_place, Memory>;

    // Once the ranks agreed on plan_: stage 2's store, the engine's buckets, this rank's shards
    // and the step's bookkeeping.
    void plan_shards() {
        auto& engine = this->engine_;
        released_.plan(this->options_.release_gradients, plan_, shard_ranks(), shard_rank(), engine.memory());
        if constexpr (!in_place) engine.share_buffers(released_.buffers());
        engine.setup(plan_, this->layout_.params);
        // The pieces' gradients: where the engine leaves each bucket's shard (stage 2: the store).
        shards_ = Shards(
            engine.memory(), engine.spare_result_slot(), this->layout_.params, plan_, shard_ranks(), shard_rank(),
            [this](std::size_t b) { return reinterpret_cast<float*>(this->engine_.reduced_buffer(b)); },
            released_.store());
        this->storage_.reset(plan_.buckets.size());
        this->readiness_.plan(plan_, this->layout_.params.size());
    }

    // In step(): the buckets grad_ready did not launch go now, on this thread, bucket after bucket
    // (a progress thread would only compete with this one for the cores); then every bucket is
    // waited for and its share kept, and the step's readiness forgotten.
    void reduce_rest() {
        const std::size_t buckets = shards_.slots.size();
        if (follow_storage(released_.launched(), buckets, /*in_backward=*/false))
            released_.release_again(this->model_, shards_, this->layout_, released_.kept());
        for (std::size_t b = released_.launched(); b < buckets; ++b) {
            this->engine_.reduce_now(b, this->tag_of(CollectivePurpose::bucket, b));
            keep_reduced(b + 1);
        }
        released_.retire_until(buckets, retire());
        end_step();
    }

    BucketPlan plan_;
    Shards shards_;

private:
    // Bucket b goes now (during backward, under the readiness lock).
    void launch(std::size_t b) {
        follow_storage(b, b + 1, /*in_backward=*/true);
        this->engine_.launch(b, this->tag_of(CollectivePurpose::bucket, b));
        keep_reduced(b + 1);
    }
    // Buckets before `launched` are launched; stage 2 keeps those reduced by now.
    void keep_reduced(std::size_t launched) {
        released_.launched_until(
            launched, [this](std::size_t k) { return this->engine_.completed(k); }, retire());
    }
    // Waits for a bucket (by one deadline, a late one named) and keeps its share.
    auto retire() {
        return [this, deadline = deadline_after(this->options_.timeout)](std::size_t b) {
            this->engine_.wait(b, deadline, this->diagnose(plan_));
            released_.keep(this->model_, shards_, this->layout_, b);
        };
    }

    // Storage that moved since the last step is followed before each bucket's reduce_scatter.
    // Returns whether the model was listed (outside backward that makes every gradient, also
    // those of buckets already released).
    bool follow_storage(std::size_t first, std::size_t last, bool in_backward) {
        if ((!this->options_.storage_may_move && !released_.on()) || first == last) return false;
        return this->follow(plan_, first, last, in_backward, [this](std::size_t b) {
            this->engine_.refresh(b, plan_.buckets[b], this->layout_.params);
            shards_.refresh(b, this->layout_.params);
        });
    }

    // Nothing ready, nothing launched.
    void end_step() {
        released_.end_step();
        this->storage_.end_step();
        this->readiness_.reset();
    }

    // Stage 2, and the buckets launched and kept this step (written under the readiness lock
    // during backward).
    ReleasedShards<Model, Memory> released_;
};

// The backend is checked first, so that a type that is not one reads that before anything else.
template <class Front, class Model, class BackendT, class... Policies>
struct ShardedCoreOf {
    static_assert(check_backend<BackendT>());
    using Set = ShardedPolicySet<Policies...>;
    using type = ShardedCore<Front, Model, BackendT, Set>;
};

}  // namespace gradsync::inline v0::detail
