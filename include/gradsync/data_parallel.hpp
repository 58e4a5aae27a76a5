// DataParallel<Model, Backend, Policies...>: wraps a model so that every rank holds the average of
// all ranks' gradients after synchronize(). With grad_ready() calls during backward, each bucket's
// allreduce starts as soon as its last gradient is ready, overlapping communication with backward.
// The front of the parts in data_parallel/: the core it shares with ShardedDataParallel (the
// grad_ready calls, failure handling, the set-up), the bucket engine (launch, wait, finalize
// pass), the finalize step (norm, clipping, the step's decision), replanning and diagnosis.
#pragma once

#include <gradsync/backend/concept_checks.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/data_parallel/buffer_sync.hpp>
#include <gradsync/data_parallel/bucket_engine.hpp>
#include <gradsync/data_parallel/diagnosis.hpp>
#include <gradsync/data_parallel/finalize_step.hpp>
#include <gradsync/data_parallel/front_core.hpp>
#include <gradsync/data_parallel/layout_agreement.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/options.hpp>
#include <gradsync/data_parallel/policies.hpp>
#include <gradsync/data_parallel/readiness.hpp>
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
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>  // for std::is_pointer_v

namespace gradsync::inline v0 {

namespace detail {
// DataParallel's core: its engine allreduces each bucket. The backend is checked first, so that
// a type that is not one reads that before anything else.
template <class Front, class Model, class BackendT, class... Policies>
struct DataParallelCoreOf {
    static_assert(check_backend<BackendT>());
    using Set = PolicySet<BackendT, Policies...>;
    using engine =
        BucketEngine<BackendT, typename Set::memory, Set::compression::wire, Set::in_place, typename Set::comm_hook>;
    using type = FrontCore<Front, Model, BackendT, engine, Options, typename Set::loss_scaler, typename Set::metrics>;
};
}  // namespace detail

// Policies, in any order, each optional (data_parallel/policies.hpp): bucketer, packing, memory,
// buffers, Options, loss scaler, compression, LR rule, communication hook, metrics.
template <class Model, class BackendT, class... Policies>
class DataParallel : public detail::DataParallelCoreOf<DataParallel<Model, BackendT, Policies...>, Model, BackendT,
                                                       Policies...>::type {
    using CoreOf = detail::DataParallelCoreOf<DataParallel, Model, BackendT, Policies...>;
    using Core = typename CoreOf::type;
    using Set = typename CoreOf::Set;
    using Phase = detail::Readiness::Phase;
    friend Core;  // calls launch() and end_step()
    using Core::current_step, Core::tag_of, Core::where, Core::guard, Core::follow, Core::diagnose;
    using Core::model_, Core::backend_, Core::options_, Core::scaler_, Core::engine_, Core::layout_, Core::readiness_,
        Core::history_, Core::storage_, Core::steps_;

public:
    using bucketer_type = typename Set::bucketer;
    using packing_type = typename Set::packing;
    using buffers_type = typename Set::buffers;
    using compression_type = typename Set::compression;
    using lr_type = typename Set::lr_rule;
    using typename Core::loss_scaler_type, typename Core::memory_type, typename Core::comm_hook_type;
    static constexpr bool reduces_in_place = Set::in_place;
    static constexpr bool gradients_untouchable = Set::gradients_untouchable;
    using engine_type = typename CoreOf::engine;
    using handle_type = typename engine_type::handle_type;

    // Lists the model's parameters and buffers, checks them on every rank, agrees on the layout
    // with every rank, and copies rank 0's parameter (and buffer) values to every rank. A problem
    // on any rank throws the same exception on every rank. Model and backend must outlive this.
    DataParallel(Model& model, BackendT& backend, Policies... policies) requires(!std::is_pointer_v<Model>)
        : Core(model, backend, std::type_identity<Set>{}, std::tuple(policies...)),
          replanning_(Set::template value<bucketer_type>(std::tuple(policies...))),
          lr_(Set::template value<lr_type>(std::tuple(policies...))) {
        init();
    }
    DataParallel(Model& model, BackendT& backend) requires(sizeof...(Policies) > 0 && !std::is_pointer_v<Model>)
        : Core(model, backend, Options{}, loss_scaler_type{}, memory_type{}) {
        init();
    }
    // A model passed by pointer (`&model`) is refused with a message saying what to write.
    // (Model&&: not deducible from an lvalue model, so deduction is never ambiguous.)
    DataParallel(Model&& model, BackendT& backend, Policies...) requires(std::is_pointer_v<Model>)
        : Core(model, backend, Options{}, loss_scaler_type{}, memory_type{}) {
        static_assert(detail::check_model_access<Model>());
    }

    // A DataParallel destroyed in the middle of a step (after an exception, say) aborts the group,
    // so that peers fail at once, and waits for its collectives in flight before it goes.
    ~DataParallel() { this->leave("DataParallel"); }

    // grad_ready(index or name) comes from the core (data_parallel/front_core.hpp): call it as
    // each parameter's gradient becomes final, and each bucket's allreduce starts during backward.
    // So do add_scalar() and metrics_path() with the StepMetrics policy.

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
        const auto began = std::chrono::steady_clock::now();
        const std::uint64_t step = steps() + 1;
        synchronize_impl(/*want_stats=*/true, true, number);
        detail::TimedOptimizer timed(optimizer);
        auto report = detail::decide_step(
            stats_, scaler_, lr_, world_size(), step, timed, [this](std::size_t p) { return layout_.params[p].name; },
            rank());
        this->finish_report(report, began, timed.seconds());
        return report;
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

    // With a hook, a float16 or bfloat16 parameter's averaged gradient in float32, unscaled and
    // clipped alike, which its 16-bit gradient was rounded from: for an optimizer with float32
    // master weights (Megatron's main_grad). Between synchronize() (or step()) and the next backward.
    // Under a device memory policy it lies in device memory, written in the trainer's stream order.
    [[nodiscard]] std::span<const float> float32_gradient(std::string_view name) const
        requires(comm_hook_type::hooked) {
        return engine_.float32_gradient(layout_, name);
    }
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
    void broadcast_parameters() { detail::broadcast_parameters(backend_, this->parameters()); }

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
    using Core::parameters, Core::buffers, Core::rank, Core::world_size, Core::steps;
    [[nodiscard]] Bytes gradient_bytes() const { return plan().bytes(); }
    // Buckets whose gradients already lie contiguously in memory, reduced without a copy.
    [[nodiscard]] std::size_t view_buckets() const { return engine_.view_buckets(); }
    // Memory this object holds for synchronization beyond the model's own buffers.
    [[nodiscard]] Bytes extra_memory() const {
        return Bytes{(layout_.params.size() * 2 + readiness_.recording_capacity()) * sizeof(std::size_t)} +
               engine_.memory_held();
    }

private:
    // Bucket b goes now (during backward, under the readiness lock).
    void launch(std::size_t b) {
        const bool timed = replanning_.timing_launches();
        const auto began = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
        follow_storage(b, b + 1, /*in_backward=*/readiness_.phase() == Phase::backward);
        engine_.launch(b, tag_of(detail::CollectivePurpose::bucket, b));
        if (timed) replanning_.launch_took(std::chrono::steady_clock::now() - began);
        detail::log(detail::LogLevel::debug, rank(), [&] {
            return "step " + std::to_string(current_step()) + ": launched bucket " + std::to_string(b);
        });
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
                        engine_.reduce_now(b, tag_of(detail::CollectivePurpose::bucket, b));
                    else
                        engine_.launch(b, tag_of(detail::CollectivePurpose::bucket, b));
                }
            }
            engine_.wait_all(detail::deadline_after(options_.timeout), diagnose(plan()));
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
            follow(plan(), first, last, in_backward, [this](std::size_t b) {
                engine_.refresh(b, plan().buckets[b], layout_.params);
                if (gradients_untouchable && !engine_.slots()[b].view)
                    throw InvalidModel(where() + ": the gradients of bucket " + std::to_string(b) +
                                       " moved and no longer lie contiguously, as device gradients must");
            });
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
        engine_.reduce_again_in_float(b, tag_of(detail::CollectivePurpose::float_redo, b));
        detail::log(detail::LogLevel::info, rank(),
                    "step " + std::to_string(current_step()) + ": bucket " + std::to_string(b) +
                        " overflowed float16 on the wire and was reduced again in float32");
    }

    // A backend whose collectives the host does not wait for reports a failure its watchdog
    // found here.
    void check_backend_health() {
        if constexpr (HealthPolling<BackendT>) backend_.throw_if_failed();
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
                                                   engine_.memory(), engine_.hook(), this->metrics_problem());
        this->start_from_rank0(buffers_type::mode);
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

    detail::Replanning<bucketer_type, Set::tunable, !gradients_untouchable> replanning_;  // the plan, the bucketer
    lr_type lr_{};
    detail::StepStats stats_;
    const StepVerdict* verdict_ = nullptr;  // in the memory policy's memory, after step_on_device
    detail::Timeline timeline_;
    detail::StatusRegistration<BackendT> reporter_;  // last: gone before what it reads
};

}  // namespace gradsync::inline v0
