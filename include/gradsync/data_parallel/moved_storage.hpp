// Gradient storage that moves between steps: a framework that frees gradients after the
// optimizer and allocates new ones in backward (libtorch 2.x's zero_grad() sets them to none)
// would leave a DataParallel reading freed memory. Before each bucket's collective the model is
// listed again and the bucket follows its gradients to where they are now: pointer compares per
// step, and new tables only for a bucket whose storage moved.
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/error.hpp>

#include <algorithm>  // for std::all_of, std::fill
#include <cstddef>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

class StorageFollower {
public:
    // A new plan of `buckets` buckets.
    void reset(std::size_t buckets) { followed_.assign(buckets, 0); }
    void end_step() { std::fill(followed_.begin(), followed_.end(), 0); }

    // Follows the storage of buckets [first, last) not followed yet this step, with one listing
    // of the model (`in_backward`: a bucket launched while backward runs); a bucket whose
    // gradients moved gets new tables from the engine. With `contiguous`, a bucket whose gradients
    // no longer lie contiguously is an error. where() begins error messages.
    template <class Model, class Engine, class Where>
    void follow(Model& model, ModelLayout& layout, const BucketPlan& plan, Engine& engine, std::size_t first,
                std::size_t last, bool in_backward, bool contiguous, const Where& where) {
        const auto begin = followed_.begin();
        if (std::all_of(begin + first, begin + last, [](char f) { return f != 0; })) return;
        const auto listed = layout.relist(model, in_backward, where);
        for (std::size_t b = first; b < last; ++b) {
            if (followed_[b] != 0) continue;
            followed_[b] = 1;
            if (!layout.follow(listed, plan.buckets[b].parameters, where)) continue;
            engine.refresh(b, plan.buckets[b], layout.params);
            if (contiguous && !engine.slots()[b].view)
                throw InvalidModel(where() + ": the gradients of bucket " + std::to_string(b) +
                                   " moved and no longer lie contiguously, as device gradients must");
        }
    }

private:
    std::vector<char> followed_;  // per bucket: followed this step
};

}  // namespace gradsync::inline v0::detail
