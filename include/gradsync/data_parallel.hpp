// DataParallel<Model, Backend, Policies...>: wraps a model so that every rank holds the average of
// all ranks' gradients after synchronize(). With grad_ready() calls during backward, each bucket's
// allreduce starts as soon as its last gradient is ready, overlapping communication with backward.
#pragma once

#include <gradsync/amp.hpp>
#include <gradsync/backend.hpp>
#include <gradsync/bucket.hpp>
#include <gradsync/buffers.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/compression.hpp>
#include <gradsync/detail/finalize.hpp>
#include <gradsync/detail/layout_agreement.hpp>
#include <gradsync/detail/log.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/detail/timeline.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>
#include <gradsync/lr.hpp>
#include <gradsync/memory.hpp>
#include <gradsync/model.hpp>
#include <gradsync/options.hpp>

#include <algorithm>  // for std::sort, std::min
#include <atomic>
#include <chrono>
#include <cmath>  // for std::sqrt, std::isfinite
#include <cstddef>
#include <cstdint>
#include <cstdio>   // for std::snprintf
#include <cstdlib>  // for std::getenv
#include <cstring>  // for std::memset
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>  // for std::is_same_v
#include <unordered_map>
#include <utility>  // for std::declval
#include <vector>

namespace gradsync::inline v0 {

// synchronize() found parameters that never got grad_ready (and find_unused_parameters is off),
// or grad_ready was misused. Peers receive the same message in a CollectiveError.
class ReadinessError : public Error {
public:
    using Error::Error;
};

// What step() did.
struct StepReport {
    bool applied = false;       // the optimizer ran: every gradient was finite
    float loss_scale = 1;       // the scale this step's gradients carried
    float next_loss_scale = 1;  // the scale for the next step's loss
    double grad_norm = 0;       // L2 norm of all averaged, unscaled gradients, before clipping; not finite on overflow
    bool clipped = false;       // the gradients were scaled down to Options::clip_norm
    double learning_rate = 0;   // what the LR policy gave the optimizer (0 without one)
    std::uint64_t step = 0;     // 1 for the first step
    std::vector<std::string> overflowed;  // parameters whose gradients were not finite
};

namespace detail {

template <class B, bool Scattered>
struct handle_of {
    using type = decltype(std::declval<B&>().allreduce_async(std::declval<Buffer>(), ReduceOp::sum));
};
template <class B>
struct handle_of<B, true> {
    using type = decltype(std::declval<B&>().allreduce_async(std::declval<std::span<const Segment>>(), DType::float32,
                                                             ReduceOp::sum));
};

}  // namespace detail

// Policies, in any order, each optional:
//   bucketer  SizeCappedBuckets (default), SingleBucket, PerParameterBuckets
//   packing   AutoPacking (default), PackedBuckets, InPlaceBuckets
//   memory    HostMemory (default)
//   buffers   BroadcastBuffers (default), BroadcastBuffersOnce, AverageBuffers, IgnoreBuffers
//   options   Options (timeout, unused parameters, bucket rebuild, timeline, clipping)
//   loss scaler  NoLossScaling (default), StaticLossScale, DynamicLossScale
//   compression  NoCompression (default), Fp16Compression, Bf16Compression
//   LR rule      NoLrRule (default), UnscaledLr, LinearLr, SqrtLr
template <class Model, class BackendT, class... Policies>
class DataParallel {
    static_assert(detail::check_model_access<Model>());
    static_assert(detail::check_backend<BackendT>());
    static_assert((detail::check_policy<Policies>() && ...));

public:
    using bucketer_type = detail::select_policy<policy_category::bucketer, SizeCappedBuckets, Policies...>;
    using packing_type = detail::select_policy<policy_category::packing, AutoPacking, Policies...>;
    using memory_type = detail::select_policy<policy_category::memory, HostMemory, Policies...>;
    using buffers_type = detail::select_policy<policy_category::buffers, BroadcastBuffers, Policies...>;
    using loss_scaler_type = detail::select_policy<policy_category::loss_scaler, NoLossScaling, Policies...>;
    using compression_type = detail::select_policy<policy_category::compression, NoCompression, Policies...>;
    using lr_type = detail::select_policy<policy_category::lr_rule, NoLrRule, Policies...>;
    static_assert(detail::check_bucketer<bucketer_type>());
    static_assert(!std::is_same_v<packing_type, InPlaceBuckets> || ScatteredAllreduce<BackendT>,
                  "gradsync: InPlaceBuckets needs a backend that reduces scattered segments "
                  "(the ScatteredAllreduce concept, e.g. LocalBackend); use PackedBuckets or AutoPacking");

    // True when gradients are reduced where they lie, with no bucket buffer and no copies.
    static constexpr bool reduces_in_place =
        std::is_same_v<packing_type, InPlaceBuckets> ||
        (std::is_same_v<packing_type, AutoPacking> && ScatteredAllreduce<BackendT>);
    using handle_type = typename detail::handle_of<BackendT, reduces_in_place>::type;

    // Gradients on the device (NcclBackend) under the host memory policy: each bucket is reduced
    // where it lies, as one contiguous buffer, and DataParallel touches no gradient memory
    // itself. The passes that would (packing, unscaling, measuring, clipping, zeroing unused
    // parameters) are refused with an error that names the device memory policy, CudaMemory.
    static constexpr bool gradients_untouchable = DeviceBackend<BackendT> && !memory_type::on_device;
    static_assert(!memory_type::on_device || DeviceBackend<BackendT>,
                  "gradsync: a device memory policy (CudaMemory) needs a backend whose collectives take device "
                  "memory (NcclBackend)");
    static_assert(!gradients_untouchable || !compression_type::compresses,
                  "gradsync: wire compression of device gradients needs a device memory policy: pass "
                  "gradsync::CudaMemory{stream} (cuda/memory.cuh), or use NoCompression");

    // Lists the model's parameters and buffers, checks them on every rank, agrees on the layout
    // with every rank, and copies rank 0's parameter (and buffer) values to every rank. A problem
    // on any rank throws the same exception on every rank. Model and backend must outlive this.
    DataParallel(Model& model, BackendT& backend, Policies... policies)
        : model_(model),
          backend_(backend),
          bucketer_(detail::policy_value<bucketer_type>(std::tuple(policies...))),
          options_(detail::policy_value<Options>(std::tuple(policies...))),
          scaler_(detail::policy_value<loss_scaler_type>(std::tuple(policies...))),
          lr_(detail::policy_value<lr_type>(std::tuple(policies...))),
          memory_(detail::policy_value<memory_type>(std::tuple(policies...))) {
        init();
    }
    DataParallel(Model& model, BackendT& backend) requires(sizeof...(Policies) > 0) : model_(model), backend_(backend) {
        init();
    }

    DataParallel(const DataParallel&) = delete;
    DataParallel& operator=(const DataParallel&) = delete;

    // A DataParallel destroyed in the middle of a step (after an exception, say) aborts the group,
    // so that peers fail at once, and waits for its collectives in flight before it goes.
    ~DataParallel() {
        if constexpr (StatusReporting<BackendT>) {
            if (reporter_) backend_.remove_status_reporter(*reporter_);
        }
        try {
            if (in_flight()) {
                abort_group("gradsync: rank " + std::to_string(rank()) + " destroyed its DataParallel in step " +
                            std::to_string(current_step()) + " with collectives in flight");
                drain();
            }
        } catch (...) {  // a destructor must not throw
        }
    }

    // Gradient of parameter `index` (its position in the model's parameter list, zero-sized ones
    // included) is final for this step. When it completes a bucket, that bucket and every bucket
    // before it that is complete are launched, in plan order. Safe to call from several threads
    // (backward hooks); all calls of a step must return before synchronize() is called.
    void grad_ready(std::size_t index) {
        guard([&] {
            if (index >= model_index_to_param_.size())
                throw ReadinessError("gradsync: rank " + std::to_string(rank()) + ", step " +
                                     std::to_string(current_step()) + ": grad_ready(" + std::to_string(index) +
                                     ") but the model has " + std::to_string(model_index_to_param_.size()) +
                                     " parameters");
            auto p = model_index_to_param_[index];
            if (p != npos) mark_ready(p);
        });
    }
    void grad_ready(std::string_view name) {
        guard([&] {
            auto it = by_name_.find(std::string(name));
            if (it == by_name_.end() || it->second == ambiguous)
                throw ReadinessError("gradsync: rank " + std::to_string(rank()) + ", step " +
                                     std::to_string(current_step()) + ": grad_ready(\"" + std::string(name) + "\"): " +
                                     (it == by_name_.end() ? "no parameter has this name"
                                                           : "several parameters have this name; use "
                                                             "grad_ready(index)"));
            if (it->second != npos) mark_ready(it->second);
        });
    }

    // Averages every parameter's gradient over all ranks. Call on every rank after backward. With
    // grad_ready() calls, waits for the launched buckets and launches the rest; without, reduces
    // every bucket now. Under no_sync() it communicates nothing. With a loss scaler, compression
    // or clipping, the finalize pass also unscales the gradients and measures their norm.
    void synchronize() { synchronize_impl(/*want_stats=*/false); }

    // synchronize(), then the optimizer if every gradient is finite: optimizer(learning rate)
    // with an LR policy, optimizer() without. The loss scaler learns of the outcome either way. A
    // skipped step leaves parameters and optimizer state untouched. The decision is the same on
    // every rank: it is taken on the reduced gradients, which every rank holds alike.
    template <class Optimizer>
    StepReport step(Optimizer&& optimizer) {
        constexpr bool with_lr = !std::is_same_v<lr_type, NoLrRule>;
        static_assert(!with_lr || std::is_invocable_v<Optimizer&, double> || std::is_invocable_v<Optimizer&>,
                      "gradsync: step(optimizer) calls optimizer(double learning_rate) or optimizer()");
        static_assert(with_lr || std::is_invocable_v<Optimizer&>,
                      "gradsync: without an LR policy (UnscaledLr, LinearLr, SqrtLr) step(optimizer) calls "
                      "optimizer() with no arguments");
        if (no_sync_depth_.load(std::memory_order_relaxed) > 0)
            throw ReadinessError("gradsync: rank " + std::to_string(rank()) +
                                 ": step() under no_sync(); call it after "
                                 "the guard is gone, on the step that synchronizes");
        StepReport report;
        report.step = steps() + 1;
        report.loss_scale = scaler_.scale();
        synchronize_impl(/*want_stats=*/true);
        report.grad_norm = grad_norm();
        report.clipped = stats_.clipped;
        if (gradients_finite()) {
            if constexpr (with_lr) {
                report.learning_rate = lr_.rate(world_size(), report.step - 1);
                if constexpr (std::is_invocable_v<Optimizer&, double>)
                    optimizer(report.learning_rate);
                else
                    optimizer();
            } else {
                optimizer();
            }
            report.applied = true;
        } else {
            for (auto p : stats_.nonfinite) report.overflowed.push_back(params_[p].name);
        }
        scaler_.update(!report.applied);
        report.next_loss_scale = scaler_.scale();
        if (!report.applied && report.next_loss_scale >= report.loss_scale && loss_scale_is_dynamic())
            detail::log(detail::LogLevel::info, rank(),
                        "step " + std::to_string(report.step) + " skipped at the minimum loss scale " +
                            std::to_string(report.loss_scale) + "; " + std::to_string(report.overflowed.size()) +
                            " parameters overflowed, the first '" + report.overflowed.front() + "'");
        return report;
    }

    // step() without the host: the verdict (whether every gradient is finite, and the sum of the
    // squares for the norm) stays in device memory, and optimizer(verdict) (or optimizer(learning
    // rate, verdict) with an LR policy) queues kernels that must read `verdict->finite` and leave
    // parameters and state alone when it is 0. The host never waits for the device in the step.
    // For CudaMemory, with no loss scaler or a static one (a dynamic scale is decided on the
    // host), no clipping and no wire compression (both need the norm or the redo on the host).
    template <class Optimizer>
    void step_on_device(Optimizer&& optimizer) requires(memory_type::on_device) {
        static_assert(!loss_scale_is_dynamic(),
                      "gradsync: step_on_device() cannot update a DynamicLossScale, which decides on the host; use "
                      "step(), or StaticLossScale");
        static_assert(!compression_type::compresses,
                      "gradsync: step_on_device() with wire compression: a float16 overflow is reduced again in "
                      "float32, which the host decides; use step()");
        if (options_.clip_norm > 0)
            throw Error("gradsync: rank " + std::to_string(rank()) +
                        ": step_on_device() cannot clip: the norm would have to come to the host; use step()");
        if (no_sync_depth_.load(std::memory_order_relaxed) > 0)
            throw ReadinessError("gradsync: rank " + std::to_string(rank()) + ": step_on_device() under no_sync()");
        const std::uint64_t step = steps() + 1;
        synchronize_impl(/*want_stats=*/true, /*read_stats=*/false);
        if constexpr (!std::is_same_v<lr_type, NoLrRule>) {
            optimizer(lr_.rate(world_size(), step - 1), verdict_);
        } else {
            optimizer(verdict_);
        }
    }

    // The factor to multiply the loss by before backward.
    [[nodiscard]] float loss_scale() const { return scaler_.scale(); }
    // The loss scaler, to save or restore its state (DynamicLossScale::state).
    [[nodiscard]] loss_scaler_type& loss_scaler() { return scaler_; }
    // The learning rate step() will pass next (an LR policy is required).
    [[nodiscard]] double learning_rate() const requires(!std::is_same_v<lr_type, NoLrRule>) {
        return lr_.rate(world_size(), steps());
    }
    // Of the last synchronize() that measured them (step(), or any synchronize() with a loss
    // scaler, compression or clipping): the global L2 norm of the unscaled averaged gradients
    // before clipping, and whether all of them were finite. step_on_device() leaves them on the
    // device, in its verdict.
    [[nodiscard]] double grad_norm() const { return std::sqrt(stats_.sum_squares); }
    [[nodiscard]] bool gradients_finite() const { return std::isfinite(stats_.sum_squares); }

    class NoSyncGuard {
    public:
        explicit NoSyncGuard(DataParallel& dp) : dp_(&dp) { dp_->no_sync_depth_.fetch_add(1); }
        NoSyncGuard(NoSyncGuard&& o) noexcept : dp_(std::exchange(o.dp_, nullptr)) {}
        NoSyncGuard(const NoSyncGuard&) = delete;
        NoSyncGuard& operator=(const NoSyncGuard&) = delete;
        NoSyncGuard& operator=(NoSyncGuard&&) = delete;
        ~NoSyncGuard() {
            if (dp_) dp_->no_sync_depth_.fetch_sub(1);
        }

    private:
        DataParallel* dp_;
    };

    // While the guard lives, backward accumulates gradients locally: grad_ready() only notes the
    // parameter as used and synchronize() communicates nothing. The next synchronized step
    // reduces the accumulated sums.
    [[nodiscard]] NoSyncGuard no_sync() {
        if (any_ready_.load(std::memory_order_acquire))
            throw ReadinessError("gradsync: rank " + std::to_string(rank()) + ", step " +
                                 std::to_string(current_step()) +
                                 ": no_sync() after grad_ready() calls of the same step; enter no_sync() before "
                                 "the backward whose gradients should only accumulate");
        return NoSyncGuard(*this);
    }

    // Copies rank 0's parameter values into every rank's parameters.
    void broadcast_parameters() {
        if (backend_.size() == 1) return;
        for (const auto& p : params_)
            backend_.broadcast(std::span(static_cast<std::byte*>(p.data), p.bytes().count()), 0);
    }

    // The bucket plan. After a bucket rebuild it changes: read it between steps.
    [[nodiscard]] const BucketPlan& plan() const { return plan_; }
    // The parameters gradsync synchronizes: the model's, in registration order, without the
    // zero-sized ones. Bucket::parameters index into this list.
    [[nodiscard]] std::span<const Parameter> parameters() const { return params_; }
    [[nodiscard]] std::span<const ModelBuffer> buffers() const { return buffers_; }
    [[nodiscard]] int rank() const { return backend_.rank(); }
    [[nodiscard]] int world_size() const { return backend_.size(); }
    // Synchronized steps completed (accumulation micro-steps under no_sync() do not count).
    [[nodiscard]] std::uint64_t steps() const { return steps_.load(std::memory_order_acquire); }
    // Sets that count, to resume from a checkpoint: step numbers and the LR rule's warm-up go on
    // from there. Between steps only, with the same value on every rank.
    void restore_steps(std::uint64_t steps) { steps_.store(steps, std::memory_order_release); }
    [[nodiscard]] Model& model() const { return model_; }
    [[nodiscard]] BackendT& backend() const { return backend_; }
    [[nodiscard]] const Options& options() const { return options_; }
    [[nodiscard]] Bytes gradient_bytes() const { return plan_.bytes(); }
    // Buckets whose gradients already lie contiguously in memory, reduced without a copy.
    [[nodiscard]] std::size_t view_buckets() const {
        std::size_t n = 0;
        for (const auto& s : slots_) n += s.view.has_value() && s.route != Route::compressed;
        return n;
    }
    // Memory this object holds for synchronization beyond the model's own buffers.
    [[nodiscard]] Bytes extra_memory() const {
        Bytes total{(params_.size() * 2 + arrivals_.capacity()) * sizeof(std::size_t)};
        for (const auto& s : slots_)
            total += Bytes{s.buffer.size() + s.widened.size() + s.segments.capacity() * sizeof(Segment) +
                           s.indices.capacity() * sizeof(std::size_t)};
        return total;
    }

private:
    static constexpr std::size_t npos = static_cast<std::size_t>(-1);
    static constexpr std::size_t ambiguous = npos - 1;
    enum class Phase : int { idle, backward, synchronizing };

    // How a bucket travels: reduced where its gradients lie (one segment when they are
    // contiguous), through a packed copy, or packed into a narrower wire dtype.
    enum class Route { in_place, view, packed, compressed };

    // One bucket's storage and the state of its collective in the current step.
    struct Slot {
        std::vector<Segment> segments;     // its gradients, by parameter index
        std::vector<std::size_t> indices;  // their parameters
        std::optional<Segment> view;       // set when they lie contiguously
        Route route = Route::in_place;
        DType wire = DType::float32;            // the dtype the collective moves
        typename memory_type::Table table;      // the segments, as the memory policy's passes take them
        bool measured = false;                  // finalized this step: its result slot is current
        typename memory_type::Storage buffer;   // packed or compressed, world > 1
        typename memory_type::Storage widened;  // a float32 copy, made once when a compressed sum overflowed
        std::size_t parameters = 0;
        std::optional<handle_type> handle;
        std::chrono::steady_clock::time_point ready_at, launched_at;
    };

    // The finalize pass's findings this step.
    struct Stats {
        double sum_squares = 0;              // of the unscaled averaged gradients
        std::vector<std::size_t> nonfinite;  // parameters with an infinity or NaN
        bool clipped = false;
    };

    // `read_stats` false: the finalize pass's measurements stay where the memory policy put them
    // (step_on_device), and the host never waits for the device.
    void synchronize_impl(bool want_stats, bool read_stats = true) {
        if (no_sync_depth_.load(std::memory_order_relaxed) > 0) return;  // an accumulation micro-step
        guard([&] {
            check_backend_health();
            const bool overlapped = any_ready_.load(std::memory_order_acquire);
            if (!overlapped) step_began_ = std::chrono::steady_clock::now();
            phase_.store(Phase::synchronizing, std::memory_order_release);
            stats_ = Stats{};
            finalizing_ = want_stats || scaler_.scale() != 1.0f || options_.clip_norm > 0;
            if constexpr (gradients_untouchable) {
                if (finalizing_)
                    throw Error("gradsync: rank " + std::to_string(rank()) +
                                ": step(), loss scaling and clipping need the finalize pass over the gradients, "
                                "which device gradients get from a device memory policy: pass "
                                "gradsync::CudaMemory{stream} (cuda/memory.cuh), or call synchronize() and apply the "
                                "optimizer (and any unscaling) yourself");
            }
            if (overlapped) {
                complete_readiness();
            } else if (backend_.size() > 1) {
                for (std::size_t b = 0; b < slots_.size(); ++b) reduce_now(b);
            }
            wait_all();
            if (backend_.size() == 1)
                for (std::size_t b = 0; b < slots_.size(); ++b) finalize_in_place(b);
            if (read_stats)
                collect_stats();
            else
                verdict_ = memory_.verdict();
            check_backend_health();  // what the device did while the host did not wait
            if (options_.clip_norm > 0) clip();
            sync_buffers(/*at_construction=*/false);
            if constexpr (!CheckedCollectives<BackendT>) {
                if (options_.check_histories.value_or(!DeviceBackend<BackendT>)) verify_histories();
            }
            timeline_.span("step", current_step(), -1, step_began_, std::chrono::steady_clock::now());
            if (overlapped) maybe_rebuild();
            reset_step();
            steps_.fetch_add(1, std::memory_order_acq_rel);
            phase_.store(Phase::idle, std::memory_order_release);
        });
    }

    [[nodiscard]] std::int64_t current_step() const {
        return static_cast<std::int64_t>(steps_.load(std::memory_order_acquire)) + 1;
    }

    void init() {
        const auto listed = gradsync::parameters(model_);
        for (std::size_t i = 0; i < listed.size(); ++i) {
            if (listed[i].count == 0) {
                model_index_to_param_.push_back(npos);
            } else {
                model_index_to_param_.push_back(params_.size());
                params_.push_back(listed[i]);
            }
            auto [it, fresh] = by_name_.emplace(listed[i].name, model_index_to_param_.back());
            if (!fresh) it->second = ambiguous;
        }
        if constexpr (buffers_type::mode != BufferSync::ignore) {
            for (auto& b : gradsync::buffers(model_))
                if (b.count != 0) buffers_.push_back(std::move(b));
        }
        std::string problem = detail::find_model_problem(std::span<const Parameter>(params_),
                                                         std::span<const ModelBuffer>(buffers_), backend_);
        if (problem.empty()) plan_ = bucketer_.plan(params_);
        if constexpr (gradients_untouchable) {
            if (problem.empty()) problem = device_gradients_problem();
        }
        if (problem.empty()) problem = stream_problem();
        if (backend_.size() == 1) {
            if (!problem.empty()) throw InvalidModel("gradsync: invalid model on rank 0: " + problem);
        } else {
            detail::agree_on_layout(backend_, std::span<const Parameter>(params_),
                                    std::span<const ModelBuffer>(buffers_), plan_, problem);
        }
        broadcast_parameters();
        sync_buffers(/*at_construction=*/true);

        ready_ = std::make_unique<std::atomic<std::uint8_t>[]>(params_.size());
        used_ = std::make_unique<std::atomic<std::uint8_t>[]>(params_.size());
        if (options_.rebuild_buckets) arrivals_.resize(params_.size());
        setup_buckets();

        std::string timeline = options_.timeline;
        if (timeline.empty()) {
            if (const char* env = std::getenv("GRADSYNC_TIMELINE")) timeline = env;
        }
        timeline_ = detail::Timeline(timeline, rank());
        if constexpr (StatusReporting<BackendT>) {
            if (backend_.size() > 1) reporter_ = backend_.add_status_reporter([this] { return describe_self(); });
        }
        if (detail::logging(detail::LogLevel::info)) {
            detail::log(
                detail::LogLevel::info, rank(),
                "DataParallel: " + std::to_string(params_.size()) + " parameters, " + std::to_string(buffers_.size()) +
                    " buffers, world size " + std::to_string(backend_.size()) + ", " +
                    (reduces_in_place ? "reduced in place" : "packed") + ", wire " + to_string(compression_type::wire) +
                    ", " + std::to_string(view_buckets()) + " view buckets; bucket plan: " + to_string(plan_));
        }
    }

    // The first k whose segment does not start where segment k - 1 ends; 0 when they all follow
    // each other in memory.
    static std::size_t first_gap(std::span<const Segment> segs, DType t) {
        const std::size_t elem = size_of(t);
        for (std::size_t k = 1; k < segs.size(); ++k)
            if (static_cast<const std::byte*>(segs[k - 1].data) + segs[k - 1].count * elem != segs[k].data) return k;
        return 0;
    }

    // Why this model cannot go the device path without a device memory policy: unused parameters
    // would be zeroed by the host, and a bucket whose gradients are not one contiguous stretch
    // would be packed by it.
    [[nodiscard]] std::string device_gradients_problem() const {
        if (options_.find_unused_parameters)
            return "find_unused_parameters zeroes unused gradients, which device gradients need a device memory "
                   "policy for: pass gradsync::CudaMemory{stream} (cuda/memory.cuh)";
        for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
            auto indices = plan_.buckets[b].parameters;
            std::sort(indices.begin(), indices.end());
            std::vector<Segment> segs;
            for (auto i : indices) segs.push_back(Segment{params_[i].grad, params_[i].count});
            if (const auto k = first_gap(segs, plan_.buckets[b].dtype); k != 0)
                return "the gradients of bucket " + std::to_string(b) + " ('" + params_[indices[k - 1]].name + "', '" +
                       params_[indices[k]].name +
                       "') are not adjacent in memory, and without a device memory policy they cannot be packed: "
                       "pass gradsync::CudaMemory{stream} (cuda/memory.cuh), or give the model one gradient buffer "
                       "in registration order (gradsync::ContiguousParameters)";
        }
        return {};
    }

    // The memory policy's passes (packing, the finalize pass) and the backend's collectives must
    // be ordered on one stream: a collective queued after another stream's packing would reduce
    // what that stream has not written yet.
    [[nodiscard]] std::string stream_problem() const {
        if constexpr (requires { backend_.compute_stream() == memory_.stream(); }) {
            const auto collectives = backend_.compute_stream();
            const auto passes = memory_.stream();
            if (!(collectives == passes)) {
                char text[160];
                std::snprintf(text, sizeof text,
                              "the memory policy's stream (%p) is not the backend's compute stream (%p)",
                              static_cast<const void*>(passes), static_cast<const void*>(collectives));
                return std::string(text) +
                       ": the collectives would not wait for the gradients packed and scaled on the other. Give both "
                       "the stream backward runs on: CudaMemory{stream} and NcclOptions::compute_stream (or the "
                       "backend's set_compute_stream(stream)) before constructing the DataParallel";
            }
        }
        return {};
    }

    // (Re)builds the per-bucket state from plan_.
    void setup_buckets() {
        const std::size_t n = plan_.buckets.size();
        bucket_of_.assign(params_.size(), npos);
        slots_.clear();
        slots_.resize(n);
        pending_ = std::make_unique<std::atomic<std::int32_t>[]>(n);
        bucket_ready_.assign(n, 0);
        for (std::size_t b = 0; b < n; ++b) {
            const auto& bucket = plan_.buckets[b];
            auto& slot = slots_[b];
            slot.indices = bucket.parameters;
            std::sort(slot.indices.begin(), slot.indices.end());  // the element layout every rank shares
            for (auto i : slot.indices) {
                bucket_of_[i] = b;
                slot.segments.push_back(Segment{params_[i].grad, params_[i].count});
            }
            slot.parameters = slot.indices.size();
            pending_[b].store(static_cast<std::int32_t>(slot.indices.size()));
            // Adjacent in memory in that order: the bucket is a view, reduced without copies.
            const bool contiguous = first_gap(slot.segments, bucket.dtype) == 0;
            if (contiguous) slot.view = Segment{slot.segments.front().data, bucket.count};
            slot.wire = bucket.dtype;
            if (compression_type::compresses && bucket.dtype == DType::float32) {
                slot.route = Route::compressed;
                slot.wire = compression_type::wire;
            } else if (reduces_in_place) {
                slot.route = Route::in_place;
            } else {
                slot.route = contiguous ? Route::view : Route::packed;
            }
            slot.table = memory_.table(slot.segments, bucket.dtype);
            if ((slot.route == Route::packed || slot.route == Route::compressed) && backend_.size() > 1)
                slot.buffer = memory_.allocate(Bytes{bucket.count * size_of(slot.wire)});
        }
        memory_.prepare_results(n);
    }

    // Runs f; on an exception, aborts the group so that peers fail now, drains, and rethrows.
    template <class F>
    void guard(F&& f) {
        try {
            f();
        } catch (const std::exception& e) {
            abort_group(e.what());
            drain();
            reset_step();
            phase_.store(Phase::idle, std::memory_order_release);
            throw;
        }
    }

    void abort_group(const std::string& reason) {
        if constexpr (Abortable<BackendT>) {
            if (backend_.size() > 1) backend_.abort(reason);
        }
    }

    void mark_ready(std::size_t p) {
        if (no_sync_depth_.load(std::memory_order_relaxed) > 0) {
            used_[p].store(1, std::memory_order_relaxed);
            return;
        }
        if (ready_[p].exchange(1, std::memory_order_acq_rel) != 0)
            throw ReadinessError("gradsync: rank " + std::to_string(rank()) + ", step " +
                                 std::to_string(current_step()) + ": grad_ready for parameter '" + params_[p].name +
                                 "' was called twice in one step");
        used_[p].store(1, std::memory_order_relaxed);
        if (!any_ready_.exchange(true, std::memory_order_acq_rel)) {
            step_began_ = std::chrono::steady_clock::now();
            phase_.store(Phase::backward, std::memory_order_release);
        }
        if (!arrivals_.empty()) {
            auto at = arrival_count_.fetch_add(1, std::memory_order_relaxed);
            if (at < arrivals_.size()) arrivals_[at] = p;
        }
        const auto b = bucket_of_[p];
        if (pending_[b].fetch_sub(1, std::memory_order_acq_rel) == 1) {
            std::lock_guard lock(launch_mutex_);
            bucket_ready_locked(b);
        }
    }

    // Bucket b is complete: launch it and every complete bucket after it, in plan order.
    void bucket_ready_locked(std::size_t b) {
        slots_[b].ready_at = std::chrono::steady_clock::now();
        bucket_ready_[b] = 1;
        while (next_launch_ < slots_.size() && bucket_ready_[next_launch_]) launch(next_launch_++);
        launched_.store(next_launch_, std::memory_order_release);
    }

    // Marks a parameter ready on the caller's behalf (under launch_mutex_).
    void mark_ready_locked(std::size_t p) {
        ready_[p].store(1, std::memory_order_release);
        const auto b = bucket_of_[p];
        if (pending_[b].fetch_sub(1, std::memory_order_acq_rel) == 1) bucket_ready_locked(b);
    }

    // At synchronize(): every parameter without grad_ready is either accumulated earlier (ready),
    // unused (zero, with find_unused_parameters) or an error; then every bucket is launched.
    void complete_readiness() {
        std::lock_guard lock(launch_mutex_);
        std::vector<std::size_t> missing;
        for (std::size_t p = 0; p < params_.size(); ++p) {
            if (ready_[p].load(std::memory_order_acquire) != 0) continue;
            if (used_[p].load(std::memory_order_relaxed) != 0) {
                mark_ready_locked(p);  // used in an accumulation micro-step: its sum is final
            } else if (options_.find_unused_parameters) {
                memory_.zero(Segment{params_[p].grad, params_[p].count}, params_[p].dtype);
                mark_ready_locked(p);
            } else {
                missing.push_back(p);
            }
        }
        if (!missing.empty()) {
            std::string names;
            for (std::size_t k = 0; k < missing.size() && k < 8; ++k) {
                names += (k ? ", '" : "'") + params_[missing[k]].name + "' (bucket " +
                         std::to_string(bucket_of_[missing[k]]) + ")";
            }
            if (missing.size() > 8) names += " and " + std::to_string(missing.size() - 8) + " more";
            throw ReadinessError("gradsync: rank " + std::to_string(rank()) + ", step " +
                                 std::to_string(current_step()) + ": synchronize() found no grad_ready for " +
                                 std::to_string(missing.size()) + " parameter" + (missing.size() == 1 ? "" : "s") +
                                 ": " + names +
                                 ". Call grad_ready for every parameter backward produced a gradient for, or pass "
                                 "gradsync::Options{.find_unused_parameters = true} to count the others as zero");
        }
    }

    CollectiveTag next_tag(std::uint64_t kind, std::int64_t bucket, std::uint64_t bytes, DType dtype) {
        fingerprint_ = detail::fnv1a(fingerprint_, ++collectives_);
        fingerprint_ = detail::fnv1a(fingerprint_, kind);
        fingerprint_ = detail::fnv1a(fingerprint_, static_cast<std::uint64_t>(bucket));
        fingerprint_ = detail::fnv1a(fingerprint_, bytes);
        fingerprint_ = detail::fnv1a(fingerprint_, static_cast<std::uint64_t>(dtype));
        return CollectiveTag{fingerprint_, current_step(), static_cast<std::int32_t>(bucket)};
    }

    // The bucket's gradients where they lie: one segment when they are a view.
    static std::span<const Segment> segments_of(const Slot& slot) {
        return slot.view ? std::span<const Segment>(&*slot.view, 1) : std::span<const Segment>(slot.segments);
    }

    // The bucket's collective as one contiguous buffer, packing (and converting) first when it is
    // no view. A compressed bucket's ranks send their share of the average: each value divided by
    // the world size, so that the sum keeps the headroom the loss scale left.
    Buffer contiguous(std::size_t b) {
        auto& slot = slots_[b];
        const auto dtype = plan_.buckets[b].dtype;
        if (slot.route == Route::view) return Buffer{slot.view->data, slot.view->count, dtype};
        std::byte* data = memory_type::data(slot.buffer);
        if (slot.route == Route::packed)
            memory_.pack(slot.table, data);
        else
            memory_.compress(slot.table, data, slot.wire, 1.0 / static_cast<double>(backend_.size()));
        return Buffer{data, plan_.buckets[b].count, slot.wire};
    }

    // The backend's collectives, carrying the tag where the backend takes one.
    void allreduce_now(std::span<const Segment> segs, DType t, ReduceOp op,
                       CollectiveTag tag) requires ScatteredAllreduce<BackendT> {
        if constexpr (requires { backend_.allreduce(segs, t, op, tag); })
            backend_.allreduce(segs, t, op, tag);
        else
            backend_.allreduce(segs, t, op);
    }
    void allreduce_now(Buffer buf, ReduceOp op, CollectiveTag tag) {
        if constexpr (requires { backend_.allreduce(buf, op, tag); })
            backend_.allreduce(buf, op, tag);
        else
            backend_.allreduce(buf, op);
    }
    handle_type allreduce_later(std::span<const Segment> segs, DType t, ReduceOp op,
                                CollectiveTag tag) requires ScatteredAllreduce<BackendT> {
        if constexpr (requires { backend_.allreduce_async(segs, t, op, tag); })
            return backend_.allreduce_async(segs, t, op, tag);
        else
            return backend_.allreduce_async(segs, t, op);
    }
    handle_type allreduce_later(Buffer buf, ReduceOp op, CollectiveTag tag) {
        if constexpr (requires { backend_.allreduce_async(buf, op, tag); })
            return backend_.allreduce_async(buf, op, tag);
        else
            return backend_.allreduce_async(buf, op);
    }

    // A compressed bucket is summed (each rank sent its share); every other one averaged.
    [[nodiscard]] static ReduceOp op_of(const Slot& slot) {
        return slot.route == Route::compressed ? ReduceOp::sum : ReduceOp::average;
    }

    // Starts bucket b's allreduce asynchronously (under launch_mutex_).
    void launch(std::size_t b) {
        auto& slot = slots_[b];
        slot.launched_at = std::chrono::steady_clock::now();
        if (backend_.size() == 1) return;  // the local gradient is already the average
        const auto& bucket = plan_.buckets[b];
        auto tag = next_tag(0, static_cast<std::int64_t>(b), bucket.count * size_of(slot.wire), slot.wire);
        if (slot.route == Route::in_place) {
            if constexpr (reduces_in_place)
                slot.handle.emplace(allreduce_later(segments_of(slot), bucket.dtype, ReduceOp::average, tag));
        } else {
            slot.handle.emplace(allreduce_later(contiguous(b), op_of(slot), tag));
        }
        detail::log(detail::LogLevel::debug, rank(),
                    "step " + std::to_string(current_step()) + ": launched bucket " + std::to_string(b));
    }

    // Reduces bucket b on this thread (the path without grad_ready: no overlap to gain); on a
    // device, queues it.
    void reduce_now(std::size_t b) {
        auto& slot = slots_[b];
        slot.ready_at = slot.launched_at = std::chrono::steady_clock::now();
        const auto& bucket = plan_.buckets[b];
        auto tag = next_tag(0, static_cast<std::int64_t>(b), bucket.count * size_of(slot.wire), slot.wire);
        if constexpr (DeviceBackend<BackendT>) {
            // Queued on the device like a launch; wait_all orders the trainer's stream after it.
            slot.handle.emplace(allreduce_later(contiguous(b), op_of(slot), tag));
            return;
        }
        if (slot.route == Route::in_place) {
            if constexpr (reduces_in_place) allreduce_now(segments_of(slot), bucket.dtype, ReduceOp::average, tag);
        } else {
            allreduce_now(contiguous(b), op_of(slot), tag);
        }
        finish(b);
        timeline_.span("allreduce", current_step(), static_cast<int>(b), slot.launched_at,
                       std::chrono::steady_clock::now());
    }

    // Waits for every launched bucket, by the deadline, and finishes each (on the device path:
    // makes the trainer's stream wait for each).
    void wait_all() {
        const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
        for (std::size_t b = 0; b < slots_.size(); ++b) {
            auto& slot = slots_[b];
            if (!slot.handle) continue;
            if constexpr (requires { backend_.wait_on_device(*slot.handle); }) {
                // The trainer's stream waits for the reduction and then runs the finalize pass the
                // memory policy queues on it; the host goes on, and the backend's watchdog ends a
                // collective that hangs.
                backend_.wait_on_device(*slot.handle);
                slot.handle.reset();
                finish(b);
                continue;
            }
            if (!slot.handle->wait_until(deadline)) throw TimeoutError(diagnose_timeout(b));
            finish(b);
            if (timeline_.enabled()) {
                timeline_.instant("ready", current_step(), static_cast<int>(b), slot.ready_at);
                timeline_.instant("launched", current_step(), static_cast<int>(b), slot.launched_at);
                timeline_.span("allreduce", current_step(), static_cast<int>(b), slot.launched_at,
                               slot.handle->finished_at());
            }
            slot.handle.reset();
        }
    }

    // After bucket b's reduction: the finalize pass. Packed buckets are unpacked in it; compressed
    // ones widened; the others scaled where they lie, or only measured when there is nothing to
    // scale. Without a loss scaler, compression, clipping or step(), a packed bucket is unpacked
    // and the others are left alone.
    void finish(std::size_t b) {
        auto& slot = slots_[b];
        const std::byte* data = memory_type::data(slot.buffer);
        switch (slot.route) {
            case Route::in_place:
            case Route::view: return finalize_in_place(b);
            case Route::packed:
                if (!finalizing_) return memory_.unpack(slot.table, data);
                return finalize_from(b, data, plan_.buckets[b].dtype);
            case Route::compressed:
                // A float16 sum that overflowed leaves the gradients intact: see collect_stats().
                return finalize_from(b, data, slot.wire);
        }
    }

    // Unscales the reduced bucket at `data`, of `type`, into the gradients, and measures it.
    void finalize_from(std::size_t b, const std::byte* data, DType type) {
        memory_.finalize(slots_[b].table, data, type, 1.0 / static_cast<double>(scaler_.scale()), b);
        slots_[b].measured = true;
    }

    // Unscales and measures bucket b's gradients where they lie.
    void finalize_in_place(std::size_t b) {
        if (!finalizing_) return;
        memory_.finalize(slots_[b].table, nullptr, plan_.buckets[b].dtype, 1.0 / static_cast<double>(scaler_.scale()),
                         b);
        slots_[b].measured = true;
    }

    // A backend whose collectives the host does not wait for (NcclBackend) reports a failure
    // found by its watchdog here.
    void check_backend_health() {
        if constexpr (requires { backend_.throw_if_failed(); }) backend_.throw_if_failed();
    }

    // The finalize pass's measurements of this step, read once (from the device: the one host
    // synchronization of a step that needs them). A bucket that is not finite is measured again
    // tensor by tensor, to name its parameters.
    void collect_stats() {
        bool any = false;
        for (const auto& slot : slots_) any = any || slot.measured;
        if (!any) return;
        auto sums = memory_.results();
        // float16 sums can overflow where float32 would not. The memory policy then leaves that
        // bucket's gradients as they were and reports it not finite; it is reduced again in
        // float32, alike on every rank (they all hold the same sum), and measured again.
        bool again = false;
        for (std::size_t b = 0; b < slots_.size(); ++b) {
            const auto& slot = slots_[b];
            if (slot.measured && slot.route == Route::compressed && slot.wire == DType::float16 &&
                !std::isfinite(sums[b])) {
                reduce_again_in_float(b);
                again = true;
            }
        }
        if (again) sums = memory_.results();
        for (std::size_t b = 0; b < slots_.size(); ++b) {
            auto& slot = slots_[b];
            if (!slot.measured) continue;
            slot.measured = false;
            stats_.sum_squares += sums[b];
            if (std::isfinite(sums[b])) continue;
            const auto per_tensor = memory_.segment_sums(slot.table);
            for (std::size_t k = 0; k < per_tensor.size(); ++k)
                if (!std::isfinite(per_tensor[k])) stats_.nonfinite.push_back(slot.indices[k]);
        }
    }

    // A compressed bucket whose float16 sum overflowed, reduced again in float32 (averaged), the
    // same on every rank: they all hold the same sum, so they all decide alike.
    void reduce_again_in_float(std::size_t b) {
        auto& slot = slots_[b];
        const auto& bucket = plan_.buckets[b];
        auto tag = next_tag(3, static_cast<std::int64_t>(b), bucket.bytes().count(), bucket.dtype);
        if constexpr (ScatteredAllreduce<BackendT>) {
            allreduce_now(segments_of(slot), bucket.dtype, ReduceOp::average, tag);
        } else {
            Buffer buf{nullptr, bucket.count, bucket.dtype};
            if (slot.view) {
                buf.data = slot.view->data;
            } else {
                if (slot.widened.size() == 0) slot.widened = memory_.allocate(bucket.bytes());
                buf.data = memory_type::data(slot.widened);
                memory_.pack(slot.table, memory_type::data(slot.widened));
            }
            allreduce_now(buf, ReduceOp::average, tag);
            if (!slot.view) memory_.unpack(slot.table, memory_type::data(slot.widened));
        }
        const bool was = finalizing_;
        finalizing_ = true;  // a compressed bucket is always finalized
        finalize_in_place(b);
        finalizing_ = was;
        detail::log(detail::LogLevel::info, rank(),
                    "step " + std::to_string(current_step()) + ": bucket " + std::to_string(b) +
                        " overflowed float16 on the wire and was reduced again in float32");
    }

    // Scales every gradient down to Options::clip_norm, when the global norm exceeds it: a
    // second pass, only when it changes something.
    void clip() {
        const double norm = grad_norm();
        if (!std::isfinite(norm) || norm <= options_.clip_norm) return;
        const double factor = options_.clip_norm / (norm + 1e-6);
        for (const auto& slot : slots_) memory_.scale(slot.table, factor);
        stats_.clipped = true;
    }

    [[nodiscard]] static constexpr bool loss_scale_is_dynamic() {
        return std::is_same_v<loss_scaler_type, DynamicLossScale>;
    }

    [[nodiscard]] bool in_flight() const {
        for (const auto& s : slots_)
            if (s.handle) return true;
        return false;
    }

    // Waits for collectives in flight, ignoring their errors: after an abort they end at once.
    void drain() {
        for (auto& slot : slots_) {
            if (!slot.handle) continue;
            try {
                (void)slot.handle->wait_until(std::chrono::steady_clock::now() + options_.timeout);
            } catch (...) {
            }
            slot.handle.reset();
        }
    }

    void reset_step() {
        for (auto& slot : slots_) slot.measured = false;
        for (std::size_t p = 0; p < params_.size(); ++p) {
            ready_[p].store(0, std::memory_order_relaxed);
            used_[p].store(0, std::memory_order_relaxed);
        }
        std::lock_guard lock(launch_mutex_);
        for (std::size_t b = 0; b < slots_.size(); ++b)
            pending_[b].store(static_cast<std::int32_t>(slots_[b].parameters), std::memory_order_relaxed);
        std::fill(bucket_ready_.begin(), bucket_ready_.end(), 0);
        next_launch_ = 0;
        launched_.store(0, std::memory_order_release);
        arrival_count_.store(0, std::memory_order_relaxed);
        any_ready_.store(false, std::memory_order_release);
    }

    // "rank 0, step 7: bucket 3 of 6 (...) not reduced within 600000 ms; rank 1: ..."
    std::string diagnose_timeout(std::size_t b) {
        const auto& bucket = plan_.buckets[b];
        std::string names;
        for (std::size_t k = 0; k < bucket.parameters.size() && k < 4; ++k)
            names += (k ? ", '" : "'") + params_[bucket.parameters[k]].name + "'";
        if (bucket.parameters.size() > 4) names += ", ...";
        std::string msg = "gradsync: rank " + std::to_string(rank()) + ", step " + std::to_string(current_step()) +
                          ": bucket " + std::to_string(b) + " of " + std::to_string(slots_.size()) + " (" +
                          to_string(bucket.bytes()) + ", " + std::to_string(bucket.parameters.size()) +
                          " parameters: " + names + ") was not reduced within " +
                          std::to_string(options_.timeout.count()) + " ms";
        if constexpr (PeerStatus<BackendT>) {
            // The ranks that entered fewer collectives than the furthest are the ones holding it up.
            const int world = backend_.size();
            std::uint64_t furthest = 0;
            for (int r = 0; r < world; ++r) furthest = std::max(furthest, backend_.peer_collectives(r));
            std::string behind;
            for (int r = 0; r < world; ++r) {
                auto entered = backend_.peer_collectives(r);
                if (entered < furthest)
                    behind += (behind.empty() ? "" : ", ") + ("rank " + std::to_string(r)) + " has entered " +
                              std::to_string(entered) + " collectives";
            }
            if (!behind.empty()) msg += ". Behind the furthest rank (" + std::to_string(furthest) + "): " + behind;
            for (int r = 0; r < world; ++r) {
                auto status = backend_.peer_status(r);
                if (!status.empty())
                    msg += "; rank " + std::to_string(r) + (r == rank() ? " (this rank)" : "") + ": " + status;
            }
        }
        return msg;
    }

    // Where this rank stands, for a peer's diagnosis. Runs on the peer's thread: reads atomics.
    std::string describe_self() const {
        std::lock_guard lock(plan_mutex_);
        const auto step = std::to_string(current_step());
        if (no_sync_depth_.load(std::memory_order_acquire) > 0)
            return "accumulating under no_sync() before step " + step;
        switch (phase_.load(std::memory_order_acquire)) {
            case Phase::idle: return "in step " + step + ", before any grad_ready() or synchronize()";
            case Phase::synchronizing: return "in synchronize() of step " + step;
            case Phase::backward: break;
        }
        const auto launched = launched_.load(std::memory_order_acquire);
        std::string out = "in the backward of step " + step + ", " + std::to_string(launched) + " of " +
                          std::to_string(slots_.size()) + " buckets launched";
        if (launched < slots_.size()) {
            const auto& bucket = plan_.buckets[launched];
            std::string names;
            std::size_t missing = 0;
            for (auto p : bucket.parameters) {
                if (ready_[p].load(std::memory_order_acquire) != 0) continue;
                if (missing++ < 6) names += (names.empty() ? "'" : ", '") + params_[p].name + "'";
            }
            if (missing > 6) names += ", ...";
            out += "; bucket " + std::to_string(launched) + " waits for grad_ready of " + names + " (" +
                   std::to_string(missing) + " of " + std::to_string(bucket.parameters.size()) + " parameters)";
        }
        return out;
    }

    // Backends that do not check tags: compare the collective histories once per step.
    void verify_histories() {
        const int world = backend_.size();
        if (world == 1) return;
        std::vector<double> table(static_cast<std::size_t>(world) * 3, 0.0);
        double* mine = table.data() + static_cast<std::size_t>(rank()) * 3;
        mine[0] = static_cast<double>(fingerprint_ >> 32);
        mine[1] = static_cast<double>(fingerprint_ & 0xffffffffu);
        mine[2] = static_cast<double>(collectives_);
        backend_.allreduce(Buffer{table.data(), table.size(), DType::float64}, ReduceOp::sum);
        for (int r = 1; r < world; ++r) {
            const double* theirs = table.data() + static_cast<std::size_t>(r) * 3;
            if (theirs[0] == table[0] && theirs[1] == table[1]) continue;
            throw CollectiveError("gradsync: step " + std::to_string(current_step()) +
                                  ": the ranks' collective histories diverged: rank 0 issued " +
                                  std::to_string(static_cast<std::uint64_t>(table[2])) + " collectives and rank " +
                                  std::to_string(r) + " " + std::to_string(static_cast<std::uint64_t>(theirs[2])) +
                                  ", with different fingerprints; every rank must launch the same buckets in the "
                                  "same order");
        }
    }

    void sync_buffers(bool at_construction) {
        constexpr auto mode = buffers_type::mode;
        if (backend_.size() == 1 || buffers_.empty() || mode == BufferSync::ignore) return;
        if (!at_construction && mode == BufferSync::broadcast_once) return;
        for (std::size_t i = 0; i < buffers_.size(); ++i) {
            auto& buf = buffers_[i];
            const bool average =
                !at_construction && mode == BufferSync::average_every_step && backend_.supports(buf.dtype);
            auto tag = next_tag(average ? 2 : 1, -2 - static_cast<std::int64_t>(i), buf.bytes().count(), buf.dtype);
            if (average) {
                allreduce_now(Buffer{buf.data, buf.count, buf.dtype}, ReduceOp::average, tag);
            } else {
                std::span<std::byte> bytes(static_cast<std::byte*>(buf.data), buf.bytes().count());
                if constexpr (requires { backend_.broadcast(bytes, 0, tag); })
                    backend_.broadcast(bytes, 0, tag);
                else
                    backend_.broadcast(bytes, 0);
            }
        }
    }

    // After the first overlapped step: buckets in the order rank 0 saw gradients become ready.
    // Not for untouchable device gradients: the new buckets might not be contiguous.
    void maybe_rebuild() {
        if (gradients_untouchable || !options_.rebuild_buckets || rebuilt_) return;
        rebuilt_ = true;
        std::vector<std::uint64_t> order;
        std::vector<bool> seen(params_.size(), false);
        const auto arrived = std::min(arrival_count_.load(std::memory_order_acquire), arrivals_.size());
        for (std::size_t k = 0; k < arrived; ++k) {
            order.push_back(arrivals_[k]);
            seen[arrivals_[k]] = true;
        }
        for (std::size_t p = params_.size(); p-- > 0;)
            if (!seen[p]) order.push_back(p);  // never ready through grad_ready: where they were
        if (backend_.size() > 1) backend_.broadcast(std::as_writable_bytes(std::span<std::uint64_t>(order)), 0);
        std::vector<std::size_t> as_indices(order.begin(), order.end());
        auto rebuilt = bucketer_.plan(params_, as_indices);
        {
            std::lock_guard lock(plan_mutex_);
            plan_ = std::move(rebuilt);
            setup_buckets();
        }
        arrivals_.clear();
        arrivals_.shrink_to_fit();
        detail::log(detail::LogLevel::info, rank(), "buckets rebuilt in rank 0's readiness order: " + to_string(plan_));
    }

    Model& model_;
    BackendT& backend_;
    bucketer_type bucketer_{};
    Options options_{};
    loss_scaler_type scaler_{};
    lr_type lr_{};
    memory_type memory_{};
    const StepVerdict* verdict_ = nullptr;  // in the memory policy's memory, after step_on_device
    Stats stats_;
    bool finalizing_ = false;  // this synchronize() unscales and measures
    std::vector<Parameter> params_;
    std::vector<ModelBuffer> buffers_;
    std::vector<std::size_t> model_index_to_param_;  // npos for zero-sized parameters
    std::unordered_map<std::string, std::size_t> by_name_;
    BucketPlan plan_;
    std::vector<Slot> slots_;             // per bucket
    std::vector<std::size_t> bucket_of_;  // per parameter

    // Readiness of the current step. Atomics: grad_ready may come from several threads, and a
    // peer's diagnosis reads them.
    std::unique_ptr<std::atomic<std::uint8_t>[]> ready_;    // grad_ready this step
    std::unique_ptr<std::atomic<std::uint8_t>[]> used_;     // grad_ready since the last synchronized step
    std::unique_ptr<std::atomic<std::int32_t>[]> pending_;  // per bucket, parameters not yet ready
    std::atomic<bool> any_ready_{false};
    std::atomic<int> no_sync_depth_{0};
    std::atomic<Phase> phase_{Phase::idle};
    std::atomic<std::uint64_t> steps_{0};
    std::atomic<std::size_t> launched_{0};
    std::mutex launch_mutex_;
    std::vector<std::uint8_t> bucket_ready_;  // under launch_mutex_
    std::size_t next_launch_ = 0;             // under launch_mutex_
    std::vector<std::size_t> arrivals_;       // readiness order, recorded until the rebuild
    std::atomic<std::size_t> arrival_count_{0};
    bool rebuilt_ = false;
    mutable std::mutex plan_mutex_;  // a peer's diagnosis against a rebuild

    std::uint64_t fingerprint_ = 14695981039346656037ull;
    std::uint64_t collectives_ = 0;
    std::optional<std::uint64_t> reporter_;
    detail::Timeline timeline_;
    std::chrono::steady_clock::time_point step_began_;
};

}  // namespace gradsync::inline v0
