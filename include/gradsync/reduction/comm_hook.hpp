// Communication hooks: a policy that decides how a bucket's gradients are averaged over the
// ranks, in place of the plain allreduce (low-rank compression, say). The bucket engine hands the
// hook each bucket's gradients as one contiguous float32 array, the parameters in it, and a
// HookComm through which it issues its collectives; every collective the hook issues is tagged
// with the step and bucket like the engine's own. start() runs when the bucket's gradients are
// final (during backward with grad_ready, else at synchronize) and returns what is in flight;
// finish() runs once that has completed, on the thread that synchronizes, and leaves the average
// in the bucket. Float16 and bfloat16 buckets reach the hook widened to float32 (exactly), and
// what it leaves is rounded once into the model's gradients: the hook computes in float32 what the
// model holds in 16 bits (Megatron reduces bfloat16 gradients in float32 for the same reason).
// float64 buckets are allreduced as without a hook; a world of one runs no hook (the local
// gradient is the average).
//
// A hook reads and writes the values on the host, so it needs gradients in host memory, unless
// it declares `static constexpr bool reads_values = false`: it then only hands bucket.values to
// its HookComm, never touches them itself, and runs wherever the gradients lie, device memory
// included (AllreduceHook). There the widening, the rounding and the collectives are queued on
// the trainer's stream, and the stream, not the host, waits for what start() returned. A hook that
// computes on the device itself declares `static constexpr bool on_device = true`: it needs
// device memory and launches its kernels on bucket.stream (CudaPowerSGD).
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/dtype.hpp>

#include <chrono>
#include <concepts>  // for std::convertible_to, std::same_as
#include <cstddef>
#include <cstdint>
#include <functional>  // for std::function
#include <memory>      // for std::shared_ptr
#include <span>
#include <string>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0 {

// One parameter of a bucket, as a hook sees it.
struct HookParameter {
    std::string name;
    std::size_t offset = 0;          // where its elements start in HookBucket::values
    std::size_t count = 0;           // elements
    std::vector<std::size_t> shape;  // as the model states it (Parameter::shape); empty: a vector

    bool operator==(const HookParameter&) const = default;
};

// A bucket, as a hook sees it.
struct HookBucket {
    std::size_t index = 0;    // in the bucket plan
    std::int64_t step = 0;    // 1 for the first
    std::span<float> values;  // in: this rank's gradients; after finish(): their average over the ranks
    std::span<const HookParameter> parameters;  // in element order, covering `values`
    float loss_scale = 1.0f;                    // the factor the gradients carry (1 without a loss scaler)
    DType dtype = DType::float32;               // the model's gradients': float16 and bfloat16 ones are widened
    // Where the values lie in device memory: the cudaStream_t their work is ordered on, which a
    // hook's kernels go on too; null on the host.
    void* stream = nullptr;
};

// The collectives a hook may issue for one bucket. Each is tagged with the step and bucket, so
// a backend that compares tags, the collective history and every error name them. Collectives
// run in the order they are issued, which must be the same on every rank.
class HookComm {
public:
    // What is in flight: one or more collectives.
    class Pending {
    public:
        Pending() = default;
        template <class Handle>
        requires(!std::same_as<Handle, Pending>) explicit Pending(Handle handle) {
            waits_.push_back([h = std::make_shared<Handle>(std::move(handle))](
                                 std::chrono::steady_clock::time_point deadline) { return h->wait_until(deadline); });
        }
        // Joins `other`: this then completes when both have.
        Pending& join(Pending other) {
            for (auto& w : other.waits_) waits_.push_back(std::move(w));
            return *this;
        }
        // False when the deadline passed first; otherwise rethrows a collective's error, if any.
        [[nodiscard]] bool wait_until(std::chrono::steady_clock::time_point deadline) const {
            for (const auto& w : waits_)
                if (!w(deadline)) return false;
            return true;
        }
        // Every collective ends by its backend's deadline.
        void wait() const { (void)wait_until(std::chrono::steady_clock::time_point::max()); }

    private:
        std::vector<std::function<bool(std::chrono::steady_clock::time_point)>> waits_;
    };

    using Issue = std::function<Pending(std::span<float>, ReduceOp)>;
    HookComm(int rank, int size, Issue issue) : rank_(rank), size_(size), issue_(std::move(issue)) {}

    // Starts an allreduce of `values` in place (ReduceOp::sum or average); they must stay valid
    // and untouched until it completes.
    [[nodiscard]] Pending allreduce_async(std::span<float> values, ReduceOp op) { return issue_(values, op); }
    void allreduce(std::span<float> values, ReduceOp op) { allreduce_async(values, op).wait(); }

    [[nodiscard]] int rank() const { return rank_; }
    [[nodiscard]] int size() const { return size_; }

private:
    int rank_, size_;
    Issue issue_;
};

// What DataParallel needs of a communication hook. settings() is agreed across the ranks like
// every other setting (the same text on every rank, or construction fails on every rank).
template <class H>
concept CommHook = std::movable<H> && requires(H h, const H ch, const HookBucket& bucket, HookComm& comm) {
    { H::hooked } -> std::convertible_to<bool>;
    { ch.settings() } -> std::convertible_to<std::string>;
    { h.start(bucket, comm) } -> std::same_as<HookComm::Pending>;
    h.finish(bucket, comm);
};

// No hook: every bucket takes the engine's own reduction (in place, packed or compressed). The
// default.
struct NoCommHook {
    using policy_category = policy_category::comm_hook;
    static constexpr bool hooked = false;
    [[nodiscard]] std::string settings() const { return "none"; }
    HookComm::Pending start(const HookBucket&, HookComm&) { return {}; }
    void finish(const HookBucket&, HookComm&) {}
};

// The plain average through a hook: one allreduce per bucket, in float32. For float32 gradients,
// the reference a hook is measured against; for float16 and bfloat16 ones, their average
// computed in float32 and rounded once, where a 16-bit allreduce rounds at every step of its sum
// (on the host or on the device: it never reads the values itself). A model of the concept to
// start a hook of your own from.
struct AllreduceHook {
    using policy_category = policy_category::comm_hook;
    static constexpr bool hooked = true;
    static constexpr bool reads_values = false;
    [[nodiscard]] std::string settings() const { return "allreduce"; }
    HookComm::Pending start(const HookBucket& bucket, HookComm& comm) {
        return comm.allreduce_async(bucket.values, ReduceOp::average);
    }
    void finish(const HookBucket&, HookComm&) {}
};

namespace detail {

// Whether hook H reads or writes bucket.values itself (true unless it declares otherwise).
template <class H>
constexpr bool hook_reads_values() {
    if constexpr (requires {
                      { H::reads_values } -> std::convertible_to<bool>;
                  })
        return H::reads_values;
    else
        return true;
}

// Whether hook H computes on the device (false unless it declares otherwise).
template <class H>
constexpr bool hook_on_device() {
    if constexpr (requires {
                      { H::on_device } -> std::convertible_to<bool>;
                  })
        return H::on_device;
    else
        return false;
}

// Where a hook may run, for either front: one that reads the values on the host needs them in host
// memory, one that computes on the device needs them in device memory; any hook over a device
// backend needs a device memory policy (the values then lie on the device).
template <class H, class B, class Memory>
constexpr bool check_comm_hook_memory() {
    static_assert(!H::hooked || !hook_on_device<H>() || Memory::on_device,
                  "gradsync: this communication hook computes on the device, and this memory policy keeps the "
                  "gradients on the host: pass gradsync::CudaMemory{stream}, or use its host counterpart "
                  "(PowerSGD for CudaPowerSGD)");
    static_assert(
        !H::hooked || !hook_reads_values<H>() || hook_on_device<H>() || (!DeviceBackend<B> && !Memory::on_device),
        "gradsync: this communication hook reads the gradients on the host, and this backend or memory "
        "policy keeps them on the device (a hook that only hands bucket.values to its HookComm declares "
        "`static constexpr bool reads_values = false` and runs on the device too)");
    static_assert(!H::hooked || !DeviceBackend<B> || Memory::on_device,
                  "gradsync: a communication hook over a backend whose collectives take device memory needs a "
                  "device memory policy: pass gradsync::CudaMemory{stream} (memory/cuda.cuh)");
    return true;
}

template <class H>
constexpr bool check_comm_hook() {
    static_assert(
        requires {
            { H::hooked } -> std::convertible_to<bool>;
        },
        "gradsync: a communication hook needs `static constexpr bool hooked = true`");
    static_assert(
        requires(const H ch) {
            { ch.settings() } -> std::convertible_to<std::string>;
        },
        "gradsync: a communication hook needs `std::string settings() const`, agreed across the ranks");
    static_assert(
        requires(H h, const HookBucket& bucket, HookComm& comm) {
            { h.start(bucket, comm) } -> std::same_as<HookComm::Pending>;
        },
        "gradsync: a communication hook needs `gradsync::HookComm::Pending start(const gradsync::HookBucket&, "
        "gradsync::HookComm&)`, which starts the bucket's collectives");
    static_assert(
        requires(H h, const HookBucket& bucket, HookComm& comm) { h.finish(bucket, comm); },
        "gradsync: a communication hook needs `void finish(const gradsync::HookBucket&, gradsync::HookComm&)`, "
        "which leaves the bucket's average in bucket.values once start()'s collectives completed");
    static_assert(std::movable<H>, "gradsync: a communication hook must be movable");
    return true;
}

}  // namespace detail

}  // namespace gradsync::inline v0
