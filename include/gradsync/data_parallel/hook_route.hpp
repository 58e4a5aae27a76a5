// HookRoute: how the bucket engine runs a communication hook (reduction/comm_hook.hpp) over a
// bucket: the bucket as the hook sees it (float32 values where they lie, packed, or 16-bit ones
// widened into a float32 copy; in host or device memory), the collectives the hook issues, each
// tagged for the bucket, and where each 16-bit parameter's float32 copy lies, for
// DataParallel::float32_gradient().
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/model/model.hpp>
#include <gradsync/reduction/comm_hook.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>  // for std::function
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>  // for std::move, std::pair
#include <vector>

namespace gradsync::inline v0::detail {

// What a communication hook's buckets need from the front: the tag of each further collective
// of bucket b (of `bytes` bytes), the loss scale the gradients carry, and where the bytes each of
// its collectives moves are counted (StepReport::bytes_reduced).
struct HookContext {
    std::function<CollectiveTag(std::size_t b, std::uint64_t bytes)> next_tag;
    std::function<float()> loss_scale;
    std::function<void(std::uint64_t bytes)> reduced;
};

// One bucket as the hook sees it, apart from its values: its index, its parameters (and their
// indices in the parameter list) and the dtype the model holds them in.
struct HookedBucket {
    std::size_t index = 0;
    std::span<const HookParameter> parameters;
    std::span<const std::size_t> indices;
    DType dtype = DType::float32;
};

template <Backend BackendT, class Hook>
class HookRoute {
public:
    explicit HookRoute(Hook hook) : hook_(std::move(hook)) {}

    void connect(HookContext context) { context_ = std::move(context); }
    // Where the gradients lie on the device: the stream their work is ordered on (HookBucket::stream).
    void set_stream(void* stream) { stream_ = stream; }

    // After every (re)plan: the hook prepares for its buckets' parameters (where it has a
    // prepare(); given the stream where the gradients lie on the device), and each parameter of a
    // widened bucket gets its place in that bucket's copy.
    void plan(std::span<const HookedBucket> buckets, std::size_t parameters) {
        float32_at_.assign(parameters, {none, 0});
        for (const auto& bucket : buckets) {
            if constexpr (requires { hook_.prepare(bucket.parameters, stream_); })
                hook_.prepare(bucket.parameters, stream_);  // a hook on the device makes its state there
            else if constexpr (requires { hook_.prepare(bucket.parameters); })
                hook_.prepare(bucket.parameters);
            if (bucket.dtype == DType::float32) continue;
            for (std::size_t k = 0; k < bucket.parameters.size(); ++k)
                float32_at_[bucket.indices[k]] = {bucket.index, bucket.parameters[k].offset};
        }
    }

    // Starts the hook's collectives over `values` (the bucket's float32 values) in step `tag.step`;
    // the first carries `tag`.
    HookComm::Pending start(BackendT& backend, const HookedBucket& bucket, std::span<float> values, CollectiveTag tag) {
        auto comm = comm_of(backend, bucket.index, tag);
        return hook_.start(view(bucket, values, tag.step), comm);
    }
    // Once they completed: the hook's finish(), which leaves the average in `values`.
    void finish(BackendT& backend, const HookedBucket& bucket, std::span<float> values, std::int64_t step) {
        auto comm = comm_of(backend, bucket.index, std::nullopt);
        hook_.finish(view(bucket, values, step), comm);
    }

    // Parameter `name`'s float32 copy in its bucket's values (copy_of(b)), or empty for a
    // zero-sized one; an error for a name the model lacks or a parameter with no copy.
    template <class CopyOf>
    [[nodiscard]] std::span<const float> float32_gradient(const ModelLayout& layout, std::string_view name,
                                                          CopyOf&& copy_of) const {
        const auto it = layout.by_name.find(std::string(name));
        const std::string call = "gradsync: float32_gradient(\"" + std::string(name) + "\"): ";
        if (it == layout.by_name.end() || it->second == ModelLayout::ambiguous)
            throw Error(call + (it == layout.by_name.end() ? "no parameter has this name"
                                                           : "several parameters have this name"));
        const std::size_t p = it->second;
        if (p == ModelLayout::none) return {};
        const auto [b, offset] = float32_at_.at(p);
        if (b == none)
            throw Error(call + "the parameter is " + to_string(layout.params[p].dtype) +
                        "; only float16 and bfloat16 gradients are averaged in a float32 copy");
        return {copy_of(b) + offset, layout.params[p].count};
    }

    [[nodiscard]] Hook& hook() { return hook_; }
    [[nodiscard]] const Hook& hook() const { return hook_; }

private:
    static constexpr std::size_t none = static_cast<std::size_t>(-1);

    // On a stream-ordered backend the trainer's stream waits for a hook's collective, not the
    // host, as for the engine's own (the backend's watchdog ends one that hangs).
    template <class Handle>
    struct StreamWait {
        BackendT* backend;
        Handle handle;
        bool wait_until(std::chrono::steady_clock::time_point) {
            backend->wait_on_device(handle);
            return true;
        }
    };

    HookBucket view(const HookedBucket& bucket, std::span<float> values, std::int64_t step) const {
        const float scale = context_.loss_scale ? context_.loss_scale() : 1.0f;
        return HookBucket{bucket.index, step, values, bucket.parameters, scale, bucket.dtype, stream_};
    }

    // The collectives of bucket b's hook: the first carries the engine's tag for the bucket, each
    // further one the next from the front.
    HookComm comm_of(BackendT& backend, std::size_t b, std::optional<CollectiveTag> first) {
        return HookComm(
            backend.rank(), backend.size(), [this, &backend, b, first](std::span<float> values, ReduceOp op) mutable {
                CollectiveTag tag = first ? *first : context_.next_tag(b, values.size_bytes());
                first.reset();
                if (context_.reduced) context_.reduced(values.size_bytes());
                auto handle =
                    allreduce_async_tagged(backend, Buffer{values.data(), values.size(), DType::float32}, op, tag);
                if constexpr (StreamOrdered<BackendT>)
                    return HookComm::Pending(StreamWait<decltype(handle)>{&backend, std::move(handle)});
                else
                    return HookComm::Pending(std::move(handle));
            });
    }

    Hook hook_;
    HookContext context_;
    void* stream_ = nullptr;
    std::vector<std::pair<std::size_t, std::size_t>> float32_at_;  // by parameter: bucket and offset, or none
};

}  // namespace gradsync::inline v0::detail
