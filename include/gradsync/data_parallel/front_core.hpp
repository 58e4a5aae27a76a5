// FrontCore: what DataParallel and ShardedDataParallel share. The model and backend a front
// serves, the parameter layout, the bucket engine, the step's readiness and collective history,
// storage following and the lifetime that callbacks watch; the grad_ready calls; the guard that
// turns a failure on this rank into the group's (data_parallel/group_failure.hpp); the set-up
// after the ranks agree; each step's report measured (step_clock.hpp) and written
// (step_metrics_log.hpp). A front derives from it and supplies launch(b) (a bucket is ready) and
// end_step() (forget the step in progress).
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/group_label.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/data_parallel/buffer_sync.hpp>
#include <gradsync/data_parallel/diagnosis.hpp>
#include <gradsync/data_parallel/group_failure.hpp>
#include <gradsync/data_parallel/history.hpp>
#include <gradsync/data_parallel/layout_agreement.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/moved_storage.hpp>
#include <gradsync/data_parallel/readiness.hpp>
#include <gradsync/data_parallel/ready_calls.hpp>
#include <gradsync/data_parallel/step_clock.hpp>
#include <gradsync/data_parallel/step_metrics_log.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/model/buffers.hpp>
#include <gradsync/model/model.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>  // for std::type_identity, std::remove_cvref_t
#include <utility>
#include <variant>

namespace gradsync::inline v0::detail {

template <class Front, class Model, class BackendT, class Engine, class OptionsT, class Scaler, class Metrics>
class FrontCore {
public:
    using comm_hook_type = typename Engine::hook_type;
    using loss_scaler_type = Scaler;
    using memory_type = std::remove_cvref_t<decltype(std::declval<const Engine&>().memory())>;

    FrontCore(const FrontCore&) = delete;
    FrontCore& operator=(const FrontCore&) = delete;

    // Gradient of parameter `index` (its position in the model's parameter list, zero-sized ones
    // included) is final for this step. When it completes a bucket, that bucket and every bucket
    // before it that is complete are launched, in plan order, so every rank issues them in the
    // same order. Safe to call from several threads (backward hooks); all calls of a step must
    // return before the step's synchronize() or step(). A misuse (a parameter reported twice in a
    // step, a name the model lacks) fails the group, as any failure in a step does.
    void grad_ready(std::size_t index) {
        guard([&] { mark(layout_.at_model_index(index)); });
    }
    void grad_ready(std::string_view name) {
        guard([&] { mark(layout_.named(name)); });
    }

    // Returns once every parameter holds the last step's values: a front that leaves collectives
    // writing them in flight after step() (ShardedOptions::gather_behind_forward) waits for them;
    // otherwise at once. A checkpoint calls it before it reads or writes the parameters.
    void wait_for_parameters() {
        if constexpr (gathers_behind()) guard([&] { front().parameter_gathers().wait_all(); });
    }

    // With StepMetrics: a scalar of the trainer's own (its loss, say), written with the next
    // step's record on rank 0 (the other ranks check the name and keep nothing). Not one of the
    // record's own names (step_metrics_log.hpp); the last value given in a step wins.
    void add_scalar(std::string_view name, double value) requires(Metrics::on) { metrics_.add(name, value); }
    // With StepMetrics: the file rank 0 writes (TensorBoard: the event file in the log directory);
    // "" on the other ranks.
    [[nodiscard]] std::string metrics_path() const requires(Metrics::on) { return metrics_.path(); }

    // The factor to multiply the loss by before backward (1 without a loss scaler).
    [[nodiscard]] float loss_scale() const { return scaler_.scale(); }
    // The loss scaler, to save or restore its state (DynamicLossScale::state; a Checkpoint does).
    [[nodiscard]] Scaler& loss_scaler() { return scaler_; }
    // The communication hook, to read or restore its state (PowerSGD's error feedback).
    [[nodiscard]] comm_hook_type& comm_hook() { return engine_.hook(); }
    // The memory policy: where the gradients lie, and how a checkpoint copies tensors to the host.
    [[nodiscard]] const auto& memory() const { return engine_.memory(); }
    // The parameters gradsync synchronizes: the model's, in registration order, without the
    // zero-sized ones. Bucket::parameters index into this list.
    [[nodiscard]] std::span<const Parameter> parameters() const { return layout_.params; }
    [[nodiscard]] std::span<const ModelBuffer> buffers() const { return layout_.buffers; }
    [[nodiscard]] int rank() const { return backend_.rank(); }
    [[nodiscard]] int world_size() const { return backend_.size(); }
    // Synchronized steps completed (accumulation micro-steps under no_sync() do not count).
    [[nodiscard]] std::uint64_t steps() const { return steps_.load(std::memory_order_acquire); }
    // Sets that count, to resume from a checkpoint: step numbers and the LR rule's warm-up go on
    // from there. Between steps only, with the same value on every rank.
    void restore_steps(std::uint64_t steps) { steps_.store(steps, std::memory_order_release); }
    [[nodiscard]] Model& model() const { return model_; }
    [[nodiscard]] BackendT& backend() const { return backend_; }
    [[nodiscard]] const OptionsT& options() const { return options_; }
    // Expires when this object is destroyed: callbacks that may outlive it (the libtorch
    // adapter's backward hooks) watch it and then call nothing.
    [[nodiscard]] std::weak_ptr<const void> lifetime() const { return lifetime_; }

protected:
    template <class... EngineArgs>
    FrontCore(Model& model, BackendT& backend, OptionsT options, Scaler scaler, EngineArgs&&... engine_args)
        : FrontCore(Metrics{}, model, backend, std::move(options), std::move(scaler),
                    std::forward<EngineArgs>(engine_args)...) {}
    // From the policies a front was given, in any order, as its policy set `Set` finds them.
    template <class Set, class... Policies>
    FrontCore(Model& model, BackendT& backend, std::type_identity<Set>, const std::tuple<Policies...>& policies)
        : FrontCore(Set::template value<Metrics>(policies), model, backend, Set::template value<OptionsT>(policies),
                    Set::template value<Scaler>(policies), Set::template value<memory_type>(policies),
                    Set::template value<comm_hook_type>(policies)) {}
    template <class... EngineArgs>
    FrontCore(const Metrics& metrics, Model& model, BackendT& backend, OptionsT options, Scaler scaler,
              EngineArgs&&... engine_args)
        : model_(model),
          backend_(backend),
          options_(std::move(options)),
          scaler_(std::move(scaler)),
          engine_(backend, std::forward<EngineArgs>(engine_args)...),
          metrics_(metrics, backend.rank()) {}
    ~FrontCore() = default;

    // For the front's destructor: callbacks stop, and a step cut short by an exception leaves no
    // collective in flight (the group is told; group_failure.hpp). Never throws.
    void leave(const char* front) noexcept {
        lifetime_.reset();
        InFlight in_flight{*this};
        abandon_in_flight(backend_, in_flight, options_.timeout, front, static_cast<std::uint64_t>(current_step()));
    }

    // The end of a step(): the report's times (the step began at `began`; the optimizer took
    // `optimizer_seconds` of it) and bytes, then the metrics policy writes it.
    void finish_report(StepReport& report, std::chrono::steady_clock::time_point began, double optimizer_seconds) {
        clock_.fill(report, began, optimizer_seconds, history_.bytes_reduced());
        metrics_.write(report);
    }
    // What keeps the metrics policy from working on this rank, or "": a set-up problem.
    [[nodiscard]] const std::string& metrics_problem() const { return metrics_.problem(); }

    // The step in progress (or the next): 1 for the first.
    [[nodiscard]] std::int64_t current_step() const { return static_cast<std::int64_t>(steps()) + 1; }
    [[nodiscard]] std::string where() const { return who(backend_) + ", step " + std::to_string(current_step()); }

    // Runs f; a failure on this rank becomes the group's: the peers are told which rank failed
    // in which step, the collectives in flight are drained, the front ends the step, and the
    // error goes on.
    template <class F>
    void guard(F&& f) {
        InFlight in_flight{*this};
        run_guarded(
            backend_, in_flight, options_.timeout, f, [this] { front().end_step(); },
            [this](const std::exception& e) {
                return failure_of(who(backend_), static_cast<std::uint64_t>(current_step()), e);
            });
    }

    // After the ranks agreed: the hook learns how to tag and count its collectives and read the
    // loss scale, every rank takes rank 0's parameters (and the buffers kept equal), and the history its
    // identity.
    void start_from_rank0(BufferSync mode) {
        if constexpr (comm_hook_type::hooked)
            engine_.connect_hook(
                {[this](std::size_t b, std::uint64_t bytes) {
                     return history_.next(CollectivePurpose::bucket, current_step(), b, bytes, DType::float32);
                 },
                 [this] { return scaler_.scale(); }, [this](std::uint64_t bytes) { history_.add_reduced(bytes); }});
        broadcast_parameters(backend_, parameters());
        history_.take_identity(backend_);
        sync_buffers(backend_, buffers(), mode, /*at_construction=*/true, history_, current_step());
    }

    // Moved storage is followed for buckets [first, last); refresh(b) rebuilds what a moved bucket
    // b invalidates. Returns whether the model was listed again.
    template <class Refresh>
    bool follow(const BucketPlan& plan, std::size_t first, std::size_t last, bool in_backward, Refresh&& refresh) {
        return storage_.follow(model_, layout_, plan, first, last, in_backward, refresh, [this] { return where(); });
    }

    // The tag of the step's next collective for `purpose`: over bucket b, its size as the
    // collective moves it (the wire dtype; the gradients' own for a redo in float32), or the
    // step's own (the sharded front's decision; b unused).
    CollectiveTag tag_of(CollectivePurpose purpose, std::size_t b = 0) {
        if (purpose == CollectivePurpose::step_decision || purpose == CollectivePurpose::overflow_report)
            return history_.next(purpose, current_step(), b, 0, DType::float32);
        const auto& slot = engine_.slots()[b];
        const DType dtype = purpose == CollectivePurpose::float_redo ? slot.dtype : slot.wire;
        const std::uint64_t bytes = slot.count * size_of(dtype);
        // The gradients' collectives count (not the sharded front's all-gathers of parameters); a
        // hook's bucket counts what its own collectives move (hook_route.hpp), not the bucket.
        const bool of_gradients = purpose == CollectivePurpose::bucket || purpose == CollectivePurpose::float_redo;
        if (of_gradients && !slot.by_hook()) history_.add_reduced(bytes);
        return history_.next(purpose, current_step(), b, bytes, dtype);
    }

    // What a wait past its deadline throws: bucket b named, with what each rank reported.
    [[nodiscard]] auto diagnose(const BucketPlan& plan) {
        return [this, &plan](std::size_t b) {
            return diagnose_timeout(backend_, current_step(), plan, parameters(), b, options_.timeout);
        };
    }

    Model& model_;
    BackendT& backend_;
    OptionsT options_{};
    Scaler scaler_{};
    Engine engine_;
    ModelLayout layout_;
    Readiness readiness_;
    CollectiveHistory history_;  // tags every collective of a step
    StorageFollower storage_;
    std::atomic<std::uint64_t> steps_{0};
    std::shared_ptr<const char> lifetime_ = std::make_shared<const char>('\0');
    StepMetricsLog<Metrics> metrics_;
    StepClock clock_;

private:
    [[nodiscard]] Front& front() { return static_cast<Front&>(*this); }
    // A front that leaves all-gathers in flight behind the next forward keeps them in a
    // ParameterGathers (parameter_gathers.hpp): waited for, checked and drained from here too.
    // (A function: asked once Front is complete.)
    static constexpr bool gathers_behind() {
        return requires(Front & f) { f.parameter_gathers(); };
    }

    // What a failure or the destructor drains: the engine's collectives and those a front keeps
    // in flight between steps (the sharded front's all-gathers behind the next forward).
    struct InFlight {
        FrontCore& core;
        [[nodiscard]] bool in_flight() const {
            if constexpr (gathers_behind())
                if (core.front().parameter_gathers().in_flight()) return true;
            return core.engine_.in_flight();
        }
        void drain(std::chrono::steady_clock::time_point deadline) {
            core.engine_.drain(deadline);
            if constexpr (gathers_behind()) core.front().parameter_gathers().drain(deadline);
        }
    };

    // Parameter p is ready: every bucket that completes goes, in plan order, through the front's
    // launch(b) (under the readiness lock). A front whose forward waits for its parameters first
    // checks that p's were waited for (a parameter with a gradient was read).
    void mark(const std::variant<std::size_t, std::string>& found) {
        if constexpr (gathers_behind())
            if (const auto* p = std::get_if<std::size_t>(&found)) front().parameter_gathers().check_read(*p);
        mark_ready(
            readiness_, layout_, found, [this](std::size_t b) { front().launch(b); }, [this] { return where(); });
    }
};

}  // namespace gradsync::inline v0::detail
