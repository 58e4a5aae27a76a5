// DataParallel<Model, Backend, Policies...>: wraps a model so that every rank holds the average of
// all ranks' gradients after synchronize(). With grad_ready() calls during backward, each bucket's
// allreduce starts as soon as its last gradient is ready, overlapping communication with backward.
// The front of the parts in data_parallel/: readiness (which gradients are final), the bucket
// engine (launch, wait, finalize pass), the finalize step (norm, clipping, the step's decision),
// the collective history, buffer sync and diagnosis.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/data_parallel/buffer_sync.hpp>
#include <gradsync/data_parallel/bucket_engine.hpp>
#include <gradsync/data_parallel/diagnosis.hpp>
#include <gradsync/data_parallel/finalize_step.hpp>
#include <gradsync/data_parallel/group_failure.hpp>
#include <gradsync/data_parallel/history.hpp>
#include <gradsync/data_parallel/layout_agreement.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/moved_storage.hpp>
#include <gradsync/data_parallel/options.hpp>
#include <gradsync/data_parallel/policies.hpp>
#include <gradsync/data_parallel/readiness.hpp>
#include <gradsync/data_parallel/ready_calls.hpp>
#include <gradsync/data_parallel/replanning.hpp>
#include <gradsync/data_parallel/setup.hpp>
#include <gradsync/data_parallel/setup_checks.hpp>
#include <gradsync/data_parallel/step_checks.hpp>
#include <gradsync/data_parallel/step_number.hpp>
#include <gradsync/data_parallel/timeline.hpp>
#include <gradsync/detail/deadline.hpp>
#include <gradsync/detail/log.hpp>
#include <gradsync/error.hpp>
#include <gradsync/memory/policy.hpp>
#include <gradsync/model/buffers.hpp>
#include <gradsync/model/model.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>  // for std::is_pointer_v
#include <variant>

namespace gradsync::inline v0 {

// Policies, in any order, each optional (data_parallel/policies.hpp): bucketer, packing, memory,
// buffers, Options, loss scaler, compression, LR rule, communication hook.
template <class Model, class BackendT, class... Policies>
class DataParallel {
    static_assert(detail::check_backend<BackendT>());
    using Set = detail::PolicySet<BackendT, Policies...>;
    using Phase = detail::Readiness::Phase;

public:
    using bucketer_type = typename Set::bucketer;
    using packing_type = typename Set::packing;
    using memory_type = typename Set::memory;
    using buffers_type = typename Set::buffers;
    using loss_scaler_type = typename Set::loss_scaler;
    using compression_type = typename Set::compression;
    using lr_type = typename Set::lr_rule;
    using comm_hook_type = typename Set::comm_hook;
    static constexpr bool reduces_in_place = Set::in_place;
    static constexpr bool gradients_untouchable = Set::gradients_untouchable;
    using engine_type =
        detail::BucketEngine<BackendT, memory_type, compression_type::wire, reduces_in_place, comm_hook_type>;
    using handle_type = typename engine_type::handle_type;

    // Lists the model's parameters and buffers, checks them on every rank, agrees on the layout
    // with every rank, and copies rank 0's parameter (and buffer) values to every rank. A problem
    // on any rank throws the same exception on every rank. Model and backend must outlive this.
    DataParallel(Model& model, BackendT& backend, Policies... policies) requires(!std::is_pointer_v<Model>)
        : model_(model),
          backend_(backend),
          replanning_(Set::template value<bucketer_type>(std::tuple(policies...))),
          options_(Set::template value<Options>(std::tuple(policies...))),
          scaler_(Set::template value<loss_scaler_type>(std::tuple(policies...))),
          lr_(Set::template value<lr_type>(std::tuple(policies...))),
          engine_(backend, Set::template value<memory_type>(std::tuple(policies...)),
                  Set::template value<comm_hook_type>(std::tuple(policies...))) {
        init();
    }
    DataParallel(Model& model, BackendT& backend) requires(sizeof...(Policies) > 0 && !std::is_pointer_v<Model>)
        : model_(model), backend_(backend), engine_(backend, memory_type{}) {
        init();
    }
    // A model passed by pointer (`&model`) is refused with a message saying what to write.
    // (Model&&: not deducible from an lvalue model, so deduction is never ambiguous.)
    DataParallel(Model&& model, BackendT& backend, Policies...) requires(std::is_pointer_v<Model>)
        : model_(model), backend_(backend), engine_(backend, memory_type{}) {
        static_assert(detail::check_model_access<Model>());
    }
    DataParallel(const DataParallel&) = delete;
    DataParallel& operator=(const DataParallel&) = delete;

    // A DataParallel destroyed in the middle of a step (after an exception, say) aborts the group,
    // so that peers fail at once, and waits for its collectives in flight before it goes.
    ~DataParallel() {
        lifetime_.reset();
        detail::abandon_in_flight(backend_, engine_, options_.timeout, "DataParallel",
                                  static_cast<std::uint64_t>(current_step()));
    }

    // Gradient of parameter `index` (its position in the model's parameter list, zero-sized ones
    // included) is final for this step. When it completes a bucket, that bucket and every bucket
    // before it that is complete are launched, in plan order. Safe to call from several threads
    // (backward hooks); all calls of a step must return before synchronize() is called.
    void grad_ready(std::size_t index) {
        guard([&] { mark(layout_.at_model_index(index)); });
    }
    void grad_ready(std::string_view name) {
        guard([&] { mark(layout_.named(name)); });
    }

    // Averages every parameter's gradient over all ranks. Call on every rank after backward. With
    // grad_ready() calls, waits for the launched buckets and launches the rest; without, reduces
    // every bucket now. Under no_sync() it communicates nothing. With a loss scaler, compression
    // or clipping, the finalize pass also unscales the gradients and measures their norm. Given
    // the trainer's step number, every rank checks that all are at the same one (one small
    // allreduce).
    void synchronize(std::optional<StepNumber> number = {}) { synchronize_impl(/*want_stats=*/false, true, number); }

    // synchronize(), then the optimizer if every gradient is finite: optimizer(learning rate)
    // with an LR policy, optimizer() without. The loss scaler learns of the outcome either way. A
    // skipped step leaves parameters and optimizer state untouched, on every rank alike. The
    // trainer's step number is checked as by synchronize().
    template <class Optimizer>
    StepReport step(Optimizer&& optimizer, std::optional<StepNumber> number = {}) {
        static_assert(detail::check_optimizer<Optimizer, Set::has_lr_rule>());
        guard([&] { detail::refuse_step(readiness_.accumulating(), /*on_device=*/false, options_.clip_norm, rank()); });
        const std::uint64_t step = steps() + 1;
        synchronize_impl(/*want_stats=*/true, true, number);
        return detail::decide_step(
            stats_, scaler_, lr_, world_size(), step, optimizer,
            [this](std::size_t p) { return layout_.params[p].name; }, rank());
    }

    // step() without the host: the verdict (whether every gradient is finite, and the sum of the
    // squares for the norm) stays in device memory, and optimizer(verdict) (or optimizer(learning
    // rate, verdict) with an LR policy) queues kernels that must read `verdict->finite` and leave
    // parameters and state alone when it is 0. The host never waits for the device in the step.
    // For CudaMemory, with no loss scaler or a static one (a dynamic scale is decided on the
    // host), no clipping and no wire compression (both need the norm or the redo on the host).
    template <class Optimizer>
    void step_on_device(Optimizer&& optimizer, std::optional<StepNumber> number = {}) requires(memory_type::on_device) {
        static_assert(detail::check_step_on_device<loss_scaler_type, compression_type>());
        guard([&] { detail::refuse_step(readiness_.accumulating(), /*on_device=*/true, options_.clip_norm, rank()); });
        const std::uint64_t step = steps() + 1;
        synchronize_impl(/*want_stats=*/true, /*read_stats=*/false, number);
        if constexpr (Set::has_lr_rule)
            optimizer(lr_.rate(world_size(), step - 1), verdict_);
        else
            optimizer(verdict_);
    }

    // The factor to multiply the loss by before backward.
    [[nodiscard]] float loss_scale() const { return scaler_.scale(); }
    // The communication hook, to read or restore its state (PowerSGD's error feedback).
    [[nodiscard]] comm_hook_type& comm_hook() { return engine_.hook(); }
    // With a hook, a float16 or bfloat16 parameter's averaged gradient in float32, unscaled and
    // clipped alike, which its 16-bit gradient was rounded from: for an optimizer with float32
    // master weights (Megatron's main_grad). Between synchronize() (or step()) and the next backward.
    [[nodiscard]] std::span<const float> float32_gradient(std::string_view name) const
        requires(comm_hook_type::hooked) {
        return engine_.float32_gradient(layout_, name);
    }
    // The loss scaler, to save or restore its state (DynamicLossScale::state).
    [[nodiscard]] loss_scaler_type& loss_scaler() { return scaler_; }
    // The learning rate step() will pass next (an LR policy is required).
    [[nodiscard]] double learning_rate() const requires(Set::has_lr_rule) { return lr_.rate(world_size(), steps()); }
    // Of the last synchronize() that measured them (step(), or any synchronize() with a loss
    // scaler, compression or clipping): the global L2 norm of the unscaled averaged gradients
    // before clipping, and whether all of them were finite. step_on_device() leaves them on the
    // device, in its verdict.
    [[nodiscard]] double grad_norm() const { return stats_.norm(); }
    [[nodiscard]] bool gradients_finite() const { return stats_.finite(); }

    using NoSyncGuard = detail::Readiness::NoSyncGuard;

    // While the guard lives, backward accumulates gradients locally: grad_ready() only notes the
    // parameter as used and synchronize() communicates nothing. The next synchronized step
    // reduces the accumulated sums. Entered after grad_ready() calls of the step, it fails the
    // group: the buckets those calls launched would otherwise let the peers complete the step.
    [[nodiscard]] NoSyncGuard no_sync() {
        guard([&] {
            if (readiness_.any_ready())
                throw ReadinessError(where() +
                                     ": no_sync() after grad_ready() calls of the same step; enter no_sync() before "
                                     "the backward whose gradients should only accumulate");
        });
        return NoSyncGuard(readiness_);
    }

    // Copies rank 0's parameter values into every rank's parameters.
    void broadcast_parameters() { detail::broadcast_parameters(backend_, parameters()); }

    // Compares every rank's parameters (and the buffers kept equal) with rank 0's, by hash; throws
    // the same ReplicaMismatch on every rank, naming the first that differs and the ranks.
    // Collective, between steps. synchronize() runs it every Options::check_replicas_every steps.
    void check_replicas() requires(!memory_type::on_device) {
        detail::check_replicas(backend_, layout_, buffers_type::mode, "after step " + std::to_string(steps()));
    }

    // The bucket plan. A bucket rebuild or autotuning changes it: read it between steps.
    [[nodiscard]] const BucketPlan& plan() const { return replanning_.plan(); }
    // The bucketer in use: after autotuning, with the caps it chose.
    [[nodiscard]] const bucketer_type& bucketer() const { return replanning_.bucketer(); }
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
    // Expires when this object is destroyed: callbacks that may outlive it (the libtorch
    // adapter's backward hooks) watch it and then call nothing.
    [[nodiscard]] std::weak_ptr<const void> lifetime() const { return lifetime_; }
    [[nodiscard]] const Options& options() const { return options_; }
    [[nodiscard]] Bytes gradient_bytes() const { return plan().bytes(); }
    // Buckets whose gradients already lie contiguously in memory, reduced without a copy.
    [[nodiscard]] std::size_t view_buckets() const { return engine_.view_buckets(); }
    // Memory this object holds for synchronization beyond the model's own buffers.
    [[nodiscard]] Bytes extra_memory() const {
        return Bytes{(layout_.params.size() * 2 + readiness_.recording_capacity()) * sizeof(std::size_t)} +
               engine_.memory_held();
    }

private:
    [[nodiscard]] std::int64_t current_step() const { return static_cast<std::int64_t>(steps()) + 1; }
    [[nodiscard]] std::string where() const {
        return detail::rank_prefix(rank()) + ", step " + std::to_string(current_step());
    }

    void mark(const std::variant<std::size_t, std::string>& found) {
        detail::mark_ready(
            readiness_, layout_, found, [this](std::size_t b) { launch(b); }, [this] { return where(); });
    }

    // Bucket b goes now (during backward, under the readiness lock).
    void launch(std::size_t b) {
        const bool timed = replanning_.timing_launches();
        const auto began = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
        follow_storage(b, b + 1, /*in_backward=*/readiness_.phase() == Phase::backward);
        engine_.launch(b, tag_of(b, detail::CollectivePurpose::bucket));
        if (timed) replanning_.launch_took(std::chrono::steady_clock::now() - began);
        detail::log(detail::LogLevel::debug, rank(), [&] {
            return "step " + std::to_string(current_step()) + ": launched bucket " + std::to_string(b);
        });
    }

    CollectiveTag tag_of(std::size_t b, detail::CollectivePurpose purpose) {
        const auto& slot = engine_.slots()[b];
        const DType dtype = purpose == detail::CollectivePurpose::float_redo ? slot.dtype : slot.wire;
        return history_.next(purpose, current_step(), b, slot.count * size_of(dtype), dtype);
    }

    // `read_stats` false: the finalize pass's measurements stay where the memory policy put them
    // (step_on_device), and the host never waits for the device.
    void synchronize_impl(bool want_stats, bool read_stats, std::optional<StepNumber> number) {
        if (readiness_.accumulating()) return;  // an accumulation micro-step
        guard([&] {
            check_backend_health();
            const bool overlapped = readiness_.any_ready();
            const auto began = overlapped ? readiness_.began() : std::chrono::steady_clock::now();
            readiness_.set_phase(Phase::synchronizing);
            stats_ = {};
            const bool finalizing = want_stats || scaler_.scale() != 1.0f || options_.clip_norm > 0;
            if (gradients_untouchable && finalizing) throw Error(detail::untouchable_gradients(rank()));
            engine_.begin_step(finalizing, 1.0 / static_cast<double>(scaler_.scale()));
            follow_storage(0, plan().buckets.size(), /*in_backward=*/false);
            if (overlapped) {
                complete_readiness();
            } else if (backend_.size() > 1) {
                // Run here where the backend's own deadline ends them by Options::timeout (the
                // fastest way); else launched, and the wait below ends by Options::timeout.
                const bool here = detail::ends_within(backend_, options_.timeout);
                for (std::size_t b = 0; b < plan().buckets.size(); ++b) {
                    if (here)
                        engine_.reduce_now(b, tag_of(b, detail::CollectivePurpose::bucket));
                    else
                        engine_.launch(b, tag_of(b, detail::CollectivePurpose::bucket));
                }
            }
            engine_.wait_all(detail::deadline_after(options_.timeout), [&](std::size_t b) {
                return detail::diagnose_timeout(backend_, current_step(), plan(), parameters(), b, options_.timeout);
            });
            if (backend_.size() == 1)
                for (std::size_t b = 0; b < plan().buckets.size(); ++b) engine_.finalize_in_place(b);
            if (read_stats)
                stats_ = detail::collect_stats(engine_, [&](std::size_t b) { reduce_again_in_float(b); });
            else
                verdict_ = engine_.memory().verdict();
            check_backend_health();  // what the device did while the host did not wait
            if (options_.clip_norm > 0) detail::clip(engine_, stats_, options_.clip_norm);
            detail::sync_buffers(backend_, buffers(), buffers_type::mode, false, history_, current_step());
            detail::check_step_end(backend_, history_, options_, memory_type::on_device, layout_, buffers_type::mode,
                                   current_step(), number);
            detail::record_step(
                timeline_, current_step(), engine_.slots(), overlapped,
                [&](std::size_t b) { return readiness_.completed_at(b); }, began);
            replan(overlapped);
            end_step();
            steps_.fetch_add(1, std::memory_order_acq_rel);
        });
    }

    // Storage that moved since the last step is followed before each bucket's collective.
    void follow_storage(std::size_t first, std::size_t last, bool in_backward) {
        if (options_.storage_may_move)
            storage_.follow(
                model_, layout_, plan(), first, last, in_backward,
                [this](std::size_t b) {
                    engine_.refresh(b, plan().buckets[b], layout_.params);
                    if (gradients_untouchable && !engine_.slots()[b].view)
                        throw InvalidModel(where() + ": the gradients of bucket " + std::to_string(b) +
                                           " moved and no longer lie contiguously, as device gradients must");
                },
                [this] { return where(); });
    }

    // At synchronize(): every parameter without grad_ready is either accumulated earlier (ready),
    // unused (zero, with find_unused_parameters) or an error; then every bucket is launched.
    void complete_readiness() {
        detail::complete_readiness(
            readiness_, layout_, [this](std::size_t b) { launch(b); },
            [this](std::size_t p) {
                if (!options_.find_unused_parameters) return false;
                const auto& param = layout_.params[p];
                engine_.memory().zero(Segment{param.grad, param.count}, param.dtype);
                return true;
            },
            [this] { return where(); });
    }

    void reduce_again_in_float(std::size_t b) {
        engine_.reduce_again_in_float(b, tag_of(b, detail::CollectivePurpose::float_redo));
        detail::log(detail::LogLevel::info, rank(),
                    "step " + std::to_string(current_step()) + ": bucket " + std::to_string(b) +
                        " overflowed float16 on the wire and was reduced again in float32");
    }

    // A backend whose collectives the host does not wait for reports a failure its watchdog
    // found here.
    void check_backend_health() {
        if constexpr (HealthPolling<BackendT>) backend_.throw_if_failed();
    }

    // Runs f; a failure on this rank becomes the group's (data_parallel/group_failure.hpp).
    template <class F>
    void guard(F&& f) {
        detail::run_guarded(backend_, engine_, options_.timeout, f, [this] { end_step(); });
    }

    void end_step() {
        storage_.end_step();
        engine_.end_step();
        readiness_.reset();
        readiness_.set_phase(Phase::idle);
    }

    // Lists the model, checks this rank's set-up, agrees with every rank, and starts in step.
    void init() {
        // Here, not in the class: a failed check in the class makes GCC report the constructor
        // call as ambiguous too.
        static_assert(detail::check_model_access<Model>());
        layout_ = detail::ModelLayout::of(model_, buffers_type::mode != BufferSync::ignore);
        auto agreed = detail::check_and_agree<Set>(backend_, layout_, replanning_.bucketer(), options_, scaler_, lr_,
                                                   engine_.memory(), engine_.hook());
        if constexpr (comm_hook_type::hooked)
            engine_.connect_hook({[this](std::size_t b, std::uint64_t bytes) {
                                      return history_.next(detail::CollectivePurpose::bucket, current_step(), b, bytes,
                                                           DType::float32);
                                  },
                                  [this] { return scaler_.scale(); }});
        broadcast_parameters();
        history_.take_identity(backend_);
        detail::sync_buffers(backend_, buffers(), buffers_type::mode, true, history_, current_step());
        replanning_.adopt(std::move(agreed), [this](const BucketPlan& p) { setup_buckets(p); });
        replanning_.start(options_, Set::autotunes(options_), world_size(), readiness_);
        timeline_ = detail::Timeline(detail::timeline_path(options_.timeline), rank());
        if (backend_.size() > 1)
            reporter_.start(backend_, [this] {
                return replanning_.read([this](const BucketPlan& plan) {
                    return detail::describe_rank(readiness_, current_step(), plan, parameters());
                });
            });
        detail::log(detail::LogLevel::info, rank(), [&] {
            return detail::describe_setup(layout_, world_size(), reduces_in_place, compression_type::wire,
                                          view_buckets(), plan());
        });
    }

    // (Re)builds the engine's and readiness's per-bucket state from `plan` (under the plan's lock).
    void setup_buckets(const BucketPlan& plan) {
        storage_.reset(plan.buckets.size());
        engine_.setup(plan, parameters());
        readiness_.plan(plan, layout_.params.size());
    }

    // Between steps: a bucket rebuild or autotuning may change the plan (replanning.hpp).
    void replan(bool overlapped) {
        const auto change = replanning_.after_step(backend_, readiness_, engine_.slots(), parameters(), overlapped,
                                                   [this](const BucketPlan& plan) { setup_buckets(plan); });
        if (!change) return;
        detail::log(detail::LogLevel::info, rank(), change->what + ": " + to_string(plan()));
        if (change->tuned) timeline_.note("buckets tuned", current_step(), change->what);
    }

    Model& model_;
    BackendT& backend_;
    detail::Replanning<bucketer_type, Set::tunable, !gradients_untouchable> replanning_;  // the plan, the bucketer
    Options options_{};
    loss_scaler_type scaler_{};
    lr_type lr_{};
    engine_type engine_;
    detail::Readiness readiness_;
    detail::CollectiveHistory history_;
    detail::StepStats stats_;
    const StepVerdict* verdict_ = nullptr;  // in the memory policy's memory, after step_on_device
    detail::ModelLayout layout_;
    std::atomic<std::uint64_t> steps_{0};
    detail::StorageFollower storage_;
    detail::Timeline timeline_;
    std::shared_ptr<const char> lifetime_ = std::make_shared<const char>('\0');
    detail::StatusRegistration<BackendT> reporter_;  // last: gone before what it reads
};

}  // namespace gradsync::inline v0
