// ShardedDataParallel<Model, Backend, Policies...>: data parallel with the optimizer's state split
// across the ranks (ZeRO stage 1; stage 2 with ShardedOptions::release_gradients). Each bucket is
// split into one shard per rank; step(optimizer) reduce-scatters the buckets through the bucket
// engine (during backward with grad_ready calls), agrees on the norm and the finite check, lets
// the optimizer update this rank's shards only, and all-gathers the parameters. Policies in any
// order (data_parallel/sharded_policies.hpp). Over NcclBackend or CudaLocalBackend, give it
// CudaMemory{stream} and the shards lie in device memory. Over TwoLevelBackend the state is split
// among a node's ranks and replicated across the nodes (hybrid sharding). docs/sharding.md says
// what it supports.
#pragma once

#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/bucket/bucketers.hpp>
#include <gradsync/bucket/plan.hpp>
#include <gradsync/data_parallel/buffer_sync.hpp>
#include <gradsync/data_parallel/finalize_step.hpp>
#include <gradsync/data_parallel/layout_agreement.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/parameter_gathers.hpp>
#include <gradsync/data_parallel/ready_calls.hpp>
#include <gradsync/data_parallel/shard_layout.hpp>
#include <gradsync/data_parallel/shard_step.hpp>
#include <gradsync/data_parallel/sharded_core.hpp>
#include <gradsync/data_parallel/sharded_options.hpp>
#include <gradsync/data_parallel/sharded_policies.hpp>
#include <gradsync/data_parallel/sharded_setup.hpp>
#include <gradsync/data_parallel/step_checks.hpp>
#include <gradsync/data_parallel/step_number.hpp>
#include <gradsync/model/gradient_release.hpp>
#include <gradsync/model/model.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>  // for std::is_invocable_v
#include <utility>      // for std::declval
#include <variant>

namespace gradsync::inline v0 {

template <class Model, class BackendT, class... Policies>
class ShardedDataParallel : public detail::ShardedCoreOf<ShardedDataParallel<Model, BackendT, Policies...>, Model,
                                                         BackendT, Policies...>::type {
    using CoreOf = detail::ShardedCoreOf<ShardedDataParallel, Model, BackendT, Policies...>;
    using Core = typename CoreOf::type;
    using Set = typename CoreOf::Set;
    friend typename Core::Base;  // asks for parameter_gathers()
    // What this front uses of the core often; the rest through this->.
    using Core::tag_of, Core::model_, Core::backend_, Core::options_, Core::scaler_, Core::engine_, Core::layout_,
        Core::history_, Core::plan_, Core::shards_;
    using Shards = typename Core::Shards;

public:
    using bucketer_type = typename Set::bucketer;
    using buffers_type = typename Set::buffers;
    using typename Core::loss_scaler_type, typename Core::memory_type, typename Core::comm_hook_type;

    // Lists the model's parameters, checks them and agrees on the layout, the plan and every
    // setting with every rank (the same exception on every rank otherwise), and copies rank 0's
    // parameter values to every rank. Model and backend must outlive this.
    // With a loss scaler (StaticLossScale, DynamicLossScale), multiply the loss by loss_scale()
    // before backward: step() unscales and skips overflowing steps, as DataParallel does.
    ShardedDataParallel(Model& model, BackendT& backend, Policies... policies)
        : Core(model, backend, std::type_identity<Set>{}, std::tuple(policies...)) {
        init(Set::template value<bucketer_type>(std::tuple(policies...)));
    }
    ShardedDataParallel(Model& model, BackendT& backend) requires(sizeof...(Policies) > 0)
        : Core(model, backend, ShardedOptions{}, loss_scaler_type{}, memory_type{}) {
        init(bucketer_type{});
    }

    // grad_ready(index or name) (data_parallel/front_core.hpp) starts each bucket's reduce_scatter
    // once its gradients are final; step() reduces the buckets not started.

    // After backward, on every rank: reduce-scatters the gradients, agrees on their norm, calls
    // optimizer(std::span<const ShardPiece<float>>) with this rank's pieces when every gradient
    // is finite (every rank decides alike), and all-gathers the parameters into every rank's
    // model. The model's gradients then hold the average in this rank's shard where the backend
    // reduces in place (LocalBackend), else are unspecified (with release_gradients: released).
    // With CudaMemory{stream} the pieces lie in device memory: queue the optimizer's kernels on
    // that stream; step() waits on the host once (the norm) and returns with the all-gathers and
    // the copies into the model queued there. Before the optimizer, the ranks compare their
    // collective histories (ShardedOptions::check_histories) and step numbers, if given: a rank
    // that skipped or repeated an iteration throws the same StepMismatch on every rank, nothing
    // updated. A failure on this rank (the optimizer threw, say) aborts the group, so that peers
    // fail at once naming this rank and step, not at their deadline; then it is rethrown.
    template <class Optimizer>
    StepReport step(Optimizer&& optimizer, std::optional<StepNumber> number = {}) {
        static_assert(std::is_invocable_v<Optimizer&, std::span<const ShardPiece<float>>>,
                      "gradsync: ShardedDataParallel::step(optimizer) calls "
                      "optimizer(std::span<const gradsync::ShardPiece<float>>)");
        StepReport report;
        const auto began = std::chrono::steady_clock::now();
        detail::TimedOptimizer timed(optimizer);
        this->guard([&] { report = step_now(timed, number); });
        this->finish_report(report, began, timed.seconds());
        return report;
    }

    // With ShardedOptions::gather_behind_forward: waits for the all-gather of the bucket that
    // holds parameter `index` (its position in the model's list) or `name`, launched by the last
    // step(), and then the parameter holds its updated value; call it before the forward reads
    // the parameter. Returns at once without the option or once waited for. On the thread that
    // runs the forward; a TimeoutError past ShardedOptions::timeout names the bucket.
    void param_ready(std::size_t index) {
        this->guard([&] { gather(layout_.at_model_index(index, "param_ready")); });
    }
    void param_ready(std::string_view name) {
        this->guard([&] { gather(layout_.named(name, "param_ready")); });
    }
    using Core::wait_for_parameters;  // every bucket's all-gather (data_parallel/front_core.hpp)

    // Destroyed with reduce_scatters in flight (an exception left the step after grad_ready
    // launched them): the group is aborted, so that peers waiting in them fail at once naming
    // this rank, and they are drained before the memory they write goes. All-gathers left behind
    // the forward are waited for (every rank launched them: no abort).
    ~ShardedDataParallel() {
        try {
            gathers_.wait_all();
        } catch (...) {  // a destructor must not throw; leave() aborts what is still in flight
        }
        this->leave("ShardedDataParallel");
    }

    using Core::parameters, Core::buffers, Core::rank, Core::world_size;
    // The plan, this rank's shards and the memory held (data_parallel/sharded_core.hpp).
    using Core::buckets_launched, Core::state_elements, Core::parameter_elements, Core::plan, Core::shard_pieces,
        Core::shard_ranks, Core::shard_rank, Core::extra_memory, Core::in_place;

private:
    // Lists the model, checks this rank's set-up, agrees with every rank, and splits the plan.
    void init(const bucketer_type& bucketer) {
        // Here, not in the class: a failed check in the class makes GCC report the constructor
        // call as ambiguous too.
        static_assert(detail::check_sharded_backend<BackendT, memory_type, comm_hook_type>());
        static_assert(detail::check_model_access<Model>());
        layout_ = detail::ModelLayout::of(model_, /*with_buffers=*/true);
        auto problems =
            detail::sharded_setup_problems(rank(), layout_, options_, bucketer, scaler_, ReleasableGradients<Model>,
                                           comm_hook_type::hooked, StreamOrdered<BackendT>);
        problems.configuration(detail::stream_problem(backend_, engine_.memory()));
        problems.configuration(this->metrics_problem());
        plan_ = problems.any() ? BucketPlan{} : bucketer.plan(layout_.params, {});
        detail::agree_on_layout(
            backend_, layout_.params, layout_.buffers, plan_,
            detail::sharded_settings(options_, bucketer, scaler_, buffers_type{}, engine_.memory(), engine_.hook()),
            problems.first());
        this->start_from_rank0(buffers_type::mode);
        this->plan_shards();
        gathers_.plan(plan_, layout_.params.size(),
                      {[this] { return this->where(); }, [this](std::size_t p) { return parameters()[p].name; },
                       [this] { return this->steps(); }, unpack(), options_.timeout});
    }

    template <class Optimizer>
    StepReport step_now(Optimizer& optimizer, std::optional<StepNumber> number) {
        StepReport report;
        const std::int64_t step = this->current_step();
        report.step = static_cast<std::uint64_t>(step);
        gathers_.check_all_waited();
        this->reduce_rest();
        detail::sync_buffers(backend_, buffers(), buffers_type::mode, /*at_construction=*/false, history_, step);
        detail::check_histories(backend_, history_, options_.check_histories, step, number);
        // This rank's share of the norm and of the finite check, then everyone's. With a loss
        // scale, the same pass unscales, as DataParallel's finalize pass does.
        detail::decide_on_shards(backend_, shards_, parameters(), scaler_, options_.clip_norm, report,
                                 [this](detail::CollectivePurpose purpose) { return tag_of(purpose); });
        const auto gather_tag = [this](std::size_t b) { return tag_of(detail::CollectivePurpose::shard_gather, b); };
        if (report.applied && options_.gather_behind_forward)
            detail::update_and_launch_gathers(backend_, shards_, optimizer, gathers_, gather_tag);
        else if (report.applied)
            detail::update_and_gather(backend_, shards_, optimizer, gather_tag);
        this->steps_.store(report.step, std::memory_order_release);
        return report;
    }

    // All-gathers behind the forward (FrontCore waits for, checks and drains them too).
    void gather(const std::variant<std::size_t, std::string>& found) {
        gathers_.wait_for_parameter(detail::named_parameter(found, [this] { return this->where(); }));
    }
    auto& parameter_gathers() { return gathers_; }
    // The packed path copies a gathered bucket into the model; in place there is nothing to do.
    [[nodiscard]] std::function<void(std::size_t)> unpack() const {
        if constexpr (in_place)
            return {};
        else
            return [this](std::size_t b) { shards_.unpack_params(b); };
    }

    // The all-gathers step() left in flight behind the next forward.
    using GatherHandle = decltype(detail::gather_async(std::declval<BackendT&>(), std::declval<const Shards&>(),
                                                       std::size_t{}, CollectiveTag{}));
    detail::ParameterGathers<GatherHandle> gathers_;
};

}  // namespace gradsync::inline v0
