// Stage 2 of ShardedDataParallel (ShardedOptions::release_gradients): once a bucket is
// reduce-scattered, this rank's share of its averaged gradients is copied into a store of the
// wrapper's (the optimizer's pieces point there) and the model is told to release the bucket's
// gradients. Off, it keeps and releases nothing.
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/data_parallel/shard_layout.hpp>
#include <gradsync/model/gradient_release.hpp>

#include <cstddef>
#include <span>
#include <vector>

namespace gradsync::inline v0::detail {

template <class Model, bool InPlace>
class ReleasedShards {
public:
    // Sizes the store for this rank's shards of `plan` when on.
    void plan(bool on, const BucketPlan& plan, int ranks, int rank) {
        on_ = on;
        store_.assign(on ? shard_elements(plan, ranks, rank) : 0, 0.0f);
    }
    [[nodiscard]] bool on() const { return on_; }
    // Where the pieces' gradients lie when on (for ShardLayout), else null.
    [[nodiscard]] float* store() { return on_ ? store_.data() : nullptr; }
    [[nodiscard]] std::size_t bytes() const { return store_.size() * sizeof(float); }

    // During backward, with buckets [0, launched) launched and [0, kept) kept: the end of those to
    // keep now. The buckets reduced by now (completed(b)) give their gradients back while backward
    // goes on, and at most two stay in flight (backward waits for the oldest), which bounds the
    // gradient memory to about two buckets beside this rank's share. Off: none.
    template <class Completed>
    [[nodiscard]] std::size_t keep_until(std::size_t kept, std::size_t launched, Completed&& completed) const {
        if (!on_) return kept;
        while (kept < launched && (completed(kept) || launched - kept > 2)) ++kept;
        return kept;
    }

    // Bucket b is reduced: its share kept, then its gradients released.
    template <class Layout>
    void keep(Model& model, const Layout& shards, const ModelLayout& layout, std::size_t b) {
        if constexpr (InPlace && ReleasableGradients<Model>) {
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
    std::vector<float> store_;                // this rank's share of the averaged gradients
    std::vector<std::size_t> model_indices_;  // a bucket's parameters, as the model counts them
};

}  // namespace gradsync::inline v0::detail
