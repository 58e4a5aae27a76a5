// Stage 2 of ShardedDataParallel (ShardedOptions::release_gradients): once a bucket is
// reduce-scattered, this rank's share of its averaged gradients is copied into a store of the
// wrapper's (the optimizer's pieces point there) and the model is told to release the bucket's
// gradients. Off, it keeps and releases nothing. The store lies where the memory policy allocates:
// beside the gradients it keeps. On a stream (CudaMemory) the copy is queued there before the
// model is told: the model frees in stream order (cudaFreeAsync on that stream, say). It also
// counts, on or off, the step's buckets launched and those waited for and kept.
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/shard_layout.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/model/gradient_release.hpp>

#include <cstddef>
#include <span>
#include <vector>

namespace gradsync::inline v0::detail {

template <class Model, class Memory>
class ReleasedShards {
    static constexpr std::size_t in_flight = 2;  // buckets reduced but not kept, at most

public:
    // When on: the store for this rank's shards of `plan`, allocated and zeroed by `memory`.
    void plan(bool on, const BucketPlan& plan, int ranks, int rank, const Memory& memory) {
        on_ = on;
        elements_ = on ? shard_elements(plan, ranks, rank) : 0;
        if (!on) return;
        store_ = memory.allocate(Bytes{elements_ * sizeof(float)});
        if (elements_ > 0) memory.zero(Segment{Memory::data(store_), elements_}, DType::float32);
    }
    [[nodiscard]] bool on() const { return on_; }
    // Where the pieces' gradients lie when on (for ShardLayout), else null.
    [[nodiscard]] float* store() { return on_ ? reinterpret_cast<float*>(Memory::data(store_)) : nullptr; }
    [[nodiscard]] std::size_t bytes() const { return elements_ * sizeof(float); }
    // The packed buffers a reduce-scattering engine needs when it lends them in turn (launched_until
    // keeps each bucket before the one three places later goes); 0 when off: one per bucket.
    [[nodiscard]] std::size_t buffers() const { return on_ ? in_flight + 1 : 0; }

    // This step's buckets [0, launched()) are launched and [0, kept()) waited for and kept.
    [[nodiscard]] std::size_t launched() const { return launched_; }
    [[nodiscard]] std::size_t kept() const { return kept_; }
    // Buckets before `launched` are launched (during backward, under the readiness lock). When on,
    // those reduced by now (completed(b)) are retired (retire(b) waits for b and keeps it) while
    // backward goes on, and at most two stay in flight (backward waits for the oldest): the
    // gradient memory stays about two buckets beside this rank's share, and a packed path may lend
    // its buckets three buffers in turn (`buffers`).
    template <class Completed, class Retire>
    void launched_until(std::size_t launched, Completed&& completed, Retire&& retire) {
        launched_ = launched;
        std::size_t end = kept_;
        while (on_ && end < launched_ && (completed(end) || launched_ - end > in_flight)) ++end;
        retire_until(end, retire);
    }
    // The buckets before `end` not kept yet, retired in order.
    template <class Retire>
    void retire_until(std::size_t end, Retire&& retire) {
        for (; kept_ < end; ++kept_) retire(kept_);
    }
    // Nothing launched, nothing kept.
    void end_step() { launched_ = kept_ = 0; }

    // Bucket b is reduced: its share kept, then its gradients released.
    template <class Layout>
    void keep(Model& model, const Layout& shards, const ModelLayout& layout, std::size_t b) {
        if constexpr (ReleasableGradients<Model>) {
            if (!on_) return;
            shards.keep_shard(b);
            release(model, shards, layout, b);
        } else {
            (void)model, (void)shards, (void)layout, (void)b;
        }
    }
    // The gradients of the buckets before `kept` released again: a listing of the model made them
    // anew.
    template <class Layout>
    void release_again(Model& model, const Layout& shards, const ModelLayout& layout, std::size_t kept) {
        for (std::size_t b = 0; on_ && b < kept; ++b) release(model, shards, layout, b);
    }
    // Bucket b's gradients released.
    template <class Layout>
    void release(Model& model, const Layout& shards, const ModelLayout& layout, std::size_t b) {
        if constexpr (ReleasableGradients<Model>) {
            model_indices_.clear();
            for (auto p : shards.slots[b].indices) model_indices_.push_back(layout.model_index_of_param[p]);
            gradsync::release_gradients(model, std::span<const std::size_t>(model_indices_));
        } else {
            (void)model, (void)shards, (void)layout, (void)b;
        }
    }

private:
    bool on_ = false;
    std::size_t elements_ = 0;
    typename Memory::Storage store_{};        // this rank's share of the averaged gradients
    std::vector<std::size_t> model_indices_;  // a bucket's parameters, as the model counts them
    std::size_t launched_ = 0;
    std::size_t kept_ = 0;
};

}  // namespace gradsync::inline v0::detail
