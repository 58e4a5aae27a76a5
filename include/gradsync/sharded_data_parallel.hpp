// ShardedDataParallel<Model, Backend>: data parallel with the optimizer's state split across the
// ranks (ZeRO stage 1). Every bucket of the plan is split into one shard per rank (shard_of); a
// rank owns its shard of every bucket. step(optimizer) reduce-scatters the gradients bucket by
// bucket (each rank receives the average over the ranks of its shards), agrees on the norm and
// the finite check with one small allreduce, lets the optimizer update only this rank's shards of
// the parameters, with only its share of the state, and all-gathers the updated parameters into
// every rank's model. A backend that reduces scattered memory (LocalBackend) does all of it where
// the gradients and parameters lie, with no copy; others get packed bucket buffers. The buckets
// go through DataParallel's bucket engine, with a reduce-scatter for its collective. With
// LocalBackend the averaged gradients are bitwise the allreduce's, so an elementwise optimizer
// ends bitwise where DataParallel's would.
//
// With grad_ready calls during backward, each bucket's reduce_scatter starts as soon as its
// gradients are final, in plan order. Policies come as DataParallel's do, in any order, each
// optional (data_parallel/sharded_policies.hpp): a bucketer, a loss scaler (unscaled in the norm
// pass), a buffer policy for the model's buffers, a communication hook (which then averages each
// bucket, packed, in place of the reduce-scatter; this rank reads its shard of the average), and
// ShardedOptions. With
// ShardedOptions::release_gradients (stage 2), each bucket's share of this rank is copied out once
// reduced and the model releases the bucket's gradients. This version: float32 parameters in host
// memory (a backend whose collectives take device memory is refused), no wire compression.
#pragma once

#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/bucketers.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/data_parallel/bucket_collective.hpp>
#include <gradsync/data_parallel/bucket_engine.hpp>
#include <gradsync/data_parallel/buffer_sync.hpp>
#include <gradsync/data_parallel/diagnosis.hpp>
#include <gradsync/data_parallel/finalize_step.hpp>
#include <gradsync/data_parallel/group_failure.hpp>
#include <gradsync/data_parallel/history.hpp>
#include <gradsync/data_parallel/layout_agreement.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/moved_storage.hpp>
#include <gradsync/data_parallel/readiness.hpp>
#include <gradsync/data_parallel/ready_calls.hpp>
#include <gradsync/data_parallel/released_shards.hpp>
#include <gradsync/data_parallel/shard_layout.hpp>
#include <gradsync/data_parallel/shard_step.hpp>
#include <gradsync/data_parallel/sharded_options.hpp>
#include <gradsync/data_parallel/sharded_policies.hpp>
#include <gradsync/data_parallel/sharded_setup.hpp>
#include <gradsync/data_parallel/step_number.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/error.hpp>
#include <gradsync/memory/host.hpp>
#include <gradsync/model/buffers.hpp>
#include <gradsync/model/gradient_release.hpp>
#include <gradsync/model/model.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>  // for std::is_invocable_v
#include <variant>
#include <vector>

namespace gradsync::inline v0 {

template <class Model, class BackendT, class... Policies>
class ShardedDataParallel {
    static_assert(detail::check_backend<BackendT>());
    using Set = detail::ShardedPolicySet<Policies...>;

public:
    using bucketer_type = typename Set::bucketer;
    using loss_scaler_type = typename Set::loss_scaler;
    using buffers_type = typename Set::buffers;
    using comm_hook_type = typename Set::comm_hook;

    // Lists the model's parameters, checks them and agrees on the layout, the plan and every
    // setting with every rank (the same exception on every rank otherwise), and copies rank 0's
    // parameter values to every rank. Model and backend must outlive this.
    // With a loss scaler (StaticLossScale, DynamicLossScale), multiply the loss by loss_scale()
    // before backward: step() unscales and skips overflowing steps, as DataParallel does.
    ShardedDataParallel(Model& model, BackendT& backend, Policies... policies)
        : model_(model),
          backend_(backend),
          options_(Set::template value<ShardedOptions>(std::tuple(policies...))),
          scaler_(Set::template value<loss_scaler_type>(std::tuple(policies...))),
          engine_(backend, HostMemory{}, Set::template value<comm_hook_type>(std::tuple(policies...))) {
        init(Set::template value<bucketer_type>(std::tuple(policies...)));
    }
    ShardedDataParallel(Model& model, BackendT& backend) requires(sizeof...(Policies) > 0)
        : model_(model), backend_(backend), engine_(backend, HostMemory{}) {
        init(bucketer_type{});
    }

    // Overlap with backward: call as each parameter's gradient becomes final (from any thread).
    // A bucket's reduce_scatter starts once all its parameters are ready and every bucket before
    // it in the plan has started, so every rank issues them in the same order; step() waits for
    // them and reduces the rest. Without these calls step() reduces every bucket itself. All
    // calls of a step must have returned before step() is called. A misuse (a parameter reported
    // twice in a step, a name the model lacks) aborts the group, as any failure in a step does.
    void grad_ready(std::size_t index) {
        guard([&] { mark(layout_.at_model_index(index)); });
    }
    void grad_ready(std::string_view name) {
        guard([&] { mark(layout_.named(name)); });
    }

    // After backward, on every rank: reduce-scatters the gradients, agrees on their norm, calls
    // optimizer(std::span<const ShardPiece<float>>) with this rank's pieces when every gradient
    // is finite (every rank decides alike), and all-gathers the parameters into every rank's
    // model. Afterwards the model's gradients hold the average in this rank's shard where the
    // backend reduces in place (LocalBackend) and are otherwise unspecified; with
    // release_gradients the model has released them all.
    // Before the optimizer, the ranks check that their collective histories agree
    // (ShardedOptions::check_histories) and, given the trainer's step number, that every rank
    // passed the same one: a rank that skipped or repeated an iteration throws the same
    // StepMismatch on every rank, with nothing updated. A failure on this rank (the optimizer
    // threw, say) aborts the group, so that peers waiting in the step's collectives fail at once
    // rather than at their deadline, naming this rank and step; then it is rethrown.
    template <class Optimizer>
    StepReport step(Optimizer&& optimizer, std::optional<StepNumber> number = {}) {
        static_assert(std::is_invocable_v<Optimizer&, std::span<const ShardPiece<float>>>,
                      "gradsync: ShardedDataParallel::step(optimizer) calls "
                      "optimizer(std::span<const gradsync::ShardPiece<float>>)");
        StepReport report;
        guard([&] { report = step_now(optimizer, number); });
        return report;
    }

    // Destroyed with reduce_scatters in flight (an exception left the step after grad_ready
    // launched them): the group is aborted, so that peers waiting in them fail at once naming
    // this rank, and they are drained before the memory they write goes.
    ~ShardedDataParallel() {
        lifetime_.reset();
        detail::abandon_in_flight(backend_, engine_, options_.timeout, "ShardedDataParallel", current_step());
    }
    ShardedDataParallel(const ShardedDataParallel&) = delete;
    ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

    // Buckets whose reduce_scatter grad_ready has started in this step (during backward).
    [[nodiscard]] std::size_t buckets_launched() const { return readiness_.launched(); }
    // Elements of this rank's shards: the length of each optimizer state array it keeps.
    [[nodiscard]] std::size_t state_elements() const { return shards_.state_elements; }
    // Elements of every parameter, for comparison: what an unsharded optimizer keeps per array.
    [[nodiscard]] std::size_t parameter_elements() const { return plan_.bytes().count() / sizeof(float); }
    [[nodiscard]] const BucketPlan& plan() const { return plan_; }
    [[nodiscard]] std::span<const Parameter> parameters() const { return layout_.params; }
    [[nodiscard]] std::span<const ModelBuffer> buffers() const { return layout_.buffers; }
    [[nodiscard]] const ShardedOptions& options() const { return options_; }
    // This rank's pieces, as step() hands them to the optimizer (the state is the trainer's).
    [[nodiscard]] std::span<const ShardPiece<float>> shard_pieces() const { return shards_.pieces; }
    [[nodiscard]] std::uint64_t steps() const { return steps_; }
    // The factor to multiply the loss by before backward (1 without a loss scaler).
    [[nodiscard]] float loss_scale() const { return scaler_.scale(); }
    // The loss scaler, to save or restore its state (a Checkpoint does).
    [[nodiscard]] loss_scaler_type& loss_scaler() { return scaler_; }
    // The communication hook, to read or restore its state (PowerSGD's error feedback).
    [[nodiscard]] comm_hook_type& comm_hook() { return engine_.hook(); }
    // For checkpoint loading: the step count to continue from.
    void restore_steps(std::uint64_t steps) { steps_ = steps; }
    [[nodiscard]] BackendT& backend() const { return backend_; }
    [[nodiscard]] Model& model() const { return model_; }
    // Expires when this object is destroyed (as DataParallel::lifetime()).
    [[nodiscard]] std::weak_ptr<const void> lifetime() const { return lifetime_; }
    [[nodiscard]] int rank() const { return backend_.rank(); }
    [[nodiscard]] int world_size() const { return backend_.size(); }
    // Memory held beyond the model's: packed bucket buffers (one for gradients and one for
    // parameters each) where the backend cannot reduce scattered memory; with release_gradients
    // this rank's share of the averaged gradients; the engine's bookkeeping.
    [[nodiscard]] Bytes extra_memory() const {
        return engine_.memory_held() + Bytes{released_.bytes() + (in_place ? 0 : parameter_elements() * sizeof(float))};
    }
    // Whether shards are reduced and gathered where they lie (ScatteredShardedCollectives).
    static constexpr bool in_place = ScatteredShardedCollectives<BackendT>;

private:
    using Engine = detail::BucketEngine<BackendT, HostMemory, DType::float32, in_place, comm_hook_type,
                                        detail::ReduceScatterBuckets>;

    // The step in progress (or the next): 1 for the first.
    [[nodiscard]] std::uint64_t current_step() const { return steps_ + 1; }

    // Lists the model, checks this rank's set-up, agrees with every rank, and splits the plan.
    void init(const bucketer_type& bucketer) {
        // Here, not in the class: a failed check in the class makes GCC report the constructor
        // call as ambiguous too.
        static_assert(detail::check_sharded_collectives<BackendT>());
        static_assert(!DeviceBackend<BackendT>,
                      "gradsync: ShardedDataParallel keeps parameters, gradients and optimizer shards in host memory, "
                      "and this backend's collectives take device memory (NcclBackend, CudaLocalBackend): for "
                      "gradients on the GPU use DataParallel with gradsync::CudaMemory{stream}");
        static_assert(detail::check_model_access<Model>());
        layout_ = detail::ModelLayout::of(model_, /*with_buffers=*/true);
        const auto problems = detail::sharded_setup_problems(rank(), layout_, options_, bucketer, scaler_, in_place,
                                                             ReleasableGradients<Model>, comm_hook_type::hooked);
        plan_ = problems.any() ? BucketPlan{} : bucketer.plan(layout_.params, {});
        detail::agree_on_layout(backend_, layout_.params, layout_.buffers, plan_,
                                detail::sharded_settings(options_, bucketer, scaler_, buffers_type{}, engine_.hook()),
                                problems.first());
        detail::broadcast_parameters(backend_, parameters());
        history_.take_identity(backend_);
        detail::sync_buffers(backend_, buffers(), buffers_type::mode, /*at_construction=*/true, history_, 0);
        released_.plan(options_.release_gradients, plan_, world_size(), rank());
        if constexpr (comm_hook_type::hooked)
            engine_.connect_hook({[this](std::size_t b, std::uint64_t bytes) {
                                      return history_.next(detail::CollectivePurpose::bucket,
                                                           static_cast<std::int64_t>(current_step()), b, bytes,
                                                           DType::float32);
                                  },
                                  [this] { return scaler_.scale(); }});
        engine_.setup(plan_, layout_.params);
        std::vector<float*> packed;  // where the engine reduces each bucket packed (a hook's too)
        for (auto& slot : engine_.slots())
            packed.push_back(slot.route == detail::Route::in_place
                                 ? nullptr
                                 : reinterpret_cast<float*>(HostMemory::data(slot.buffer)));
        shards_ = detail::ShardLayout<in_place>(layout_.params, plan_, world_size(), rank(), packed, released_.store());
        storage_.reset(plan_.buckets.size());
        readiness_.plan(plan_, layout_.params.size());
    }

    template <class Optimizer>
    StepReport step_now(Optimizer& optimizer, std::optional<StepNumber> number) {
        StepReport report;
        report.step = current_step();
        const auto step = static_cast<std::int64_t>(report.step);
        {
            // The buckets grad_ready did not launch go now, on this thread, bucket after bucket
            // (a progress thread would only compete with this one for the cores); then every
            // bucket is waited for and its share kept.
            if (follow_storage(launched_, shards_.slots.size(), /*in_backward=*/false) && released_.on())
                for (std::size_t b = 0; b < kept_; ++b) released_.release(model_, shards_, layout_, b);  // made again
            for (std::size_t b = launched_; b < shards_.slots.size(); ++b)
                engine_.reduce_now(b, tag_of(detail::CollectivePurpose::bucket, b));
            retire(shards_.slots.size(), detail::deadline_after(options_.timeout));
            new_step();
        }
        detail::sync_buffers(backend_, buffers(), buffers_type::mode, /*at_construction=*/false, history_, step);
        const bool histories = options_.check_histories && !CheckedCollectives<BackendT>;
        if (histories || number) history_.verify(backend_, step, number ? std::optional(number->value) : std::nullopt);
        // This rank's share of the norm and of the finite check, then everyone's. With a loss
        // scale, the same pass unscales, as DataParallel's finalize pass does.
        detail::decide_on_shards(backend_, shards_, parameters(), scaler_, options_.clip_norm, report,
                                 [this](detail::CollectivePurpose purpose) { return tag_of(purpose, 0); });
        if (report.applied)
            detail::update_and_gather(backend_, shards_, optimizer, [this](std::size_t b) {
                return tag_of(detail::CollectivePurpose::shard_gather, b);
            });
        steps_ = report.step;
        return report;
    }

    // The tag of the step's next collective: bucket b's reduce_scatter or all_gather, or the
    // step's decision (b unused).
    CollectiveTag tag_of(detail::CollectivePurpose purpose, std::size_t b) {
        const auto& bucket = plan_.buckets[b];
        const bool of_bucket =
            purpose == detail::CollectivePurpose::bucket || purpose == detail::CollectivePurpose::shard_gather;
        return history_.next(purpose, static_cast<std::int64_t>(current_step()), b,
                             of_bucket ? bucket.bytes().count() : 0, DType::float32);
    }

    // Waits for the buckets before `end` still in flight (by `deadline`, a late one named) and
    // keeps each one's share.
    void retire(std::size_t end, std::chrono::steady_clock::time_point deadline) {
        for (; kept_ < end; ++kept_) {
            engine_.wait(kept_, deadline, [this](std::size_t b) {
                return detail::diagnose_timeout(backend_, static_cast<std::int64_t>(current_step()), plan_,
                                                parameters(), b, options_.timeout);
            });
            released_.keep(model_, shards_, layout_, kept_);
        }
    }

    // Runs f; a failure on this rank becomes the group's (data_parallel/group_failure.hpp): the
    // peers are told which rank failed in which step.
    template <class F>
    void guard(F&& f) {
        detail::run_guarded(
            backend_, engine_, options_.timeout, f, [this] { new_step(); },
            [this](const std::exception& e) { return detail::failure_of(rank(), current_step(), e); });
    }

    // Parameter p is ready: every bucket that completes goes, in plan order (Readiness).
    void mark(const std::variant<std::size_t, std::string>& found) {
        detail::mark_ready(
            readiness_, layout_, found, [this](std::size_t b) { launch(b); }, [this] { return where(); });
    }

    // Bucket b goes now (during backward, under the readiness lock).
    void launch(std::size_t b) {
        follow_storage(b, b + 1, /*in_backward=*/true);
        engine_.launch(b, tag_of(detail::CollectivePurpose::bucket, b));
        launched_ = b + 1;
        // Stage 2: the buckets reduced by now give their gradients back while backward goes on,
        // and at most two stay in flight (backward waits for the oldest), which bounds the
        // gradient memory to about two buckets beside this rank's share.
        if (!released_.on()) return;
        std::size_t end = kept_;
        while (end < launched_ && (engine_.completed(end) || launched_ - end > 2)) ++end;
        retire(end, detail::deadline_after(options_.timeout));
    }

    [[nodiscard]] std::string where() const {
        return detail::rank_prefix(rank()) + ", step " + std::to_string(current_step());
    }

    // Storage that moved since the last step is followed before each bucket's reduce_scatter.
    // Returns whether the model was listed (outside backward that makes every gradient, also
    // those of buckets already released).
    bool follow_storage(std::size_t first, std::size_t last, bool in_backward) {
        if ((!options_.storage_may_move && !released_.on()) || first == last) return false;
        return storage_.follow(
            model_, layout_, plan_, first, last, in_backward,
            [this](std::size_t b) {
                engine_.refresh(b, plan_.buckets[b], layout_.params);
                shards_.refresh(b, layout_.params);
            },
            [this] { return where(); });
    }

    // Nothing ready, nothing launched.
    void new_step() {
        launched_ = 0;
        kept_ = 0;
        storage_.end_step();
        readiness_.reset();
    }

    Model& model_;
    BackendT& backend_;
    ShardedOptions options_{};
    loss_scaler_type scaler_{};
    detail::ModelLayout layout_;
    BucketPlan plan_;
    Engine engine_;  // each bucket's reduce_scatter
    detail::ShardLayout<in_place> shards_;
    std::uint64_t steps_ = 0;
    detail::CollectiveHistory history_;  // tags every collective of a step
    detail::StorageFollower storage_;
    detail::ReleasedShards<Model, in_place> released_;  // stage 2
    // Overlap: which parameters grad_ready reported this step, and the reduce_scatters launched
    // (buckets 0 .. launched_ - 1; written under the readiness lock during backward).
    detail::Readiness readiness_;
    std::size_t launched_ = 0;
    std::size_t kept_ = 0;  // launched buckets waited for and kept
    std::shared_ptr<const char> lifetime_ = std::make_shared<const char>('\0');
};

}  // namespace gradsync::inline v0
