// Gradient storage that moves between steps: a framework that frees gradients after the
// optimizer and allocates new ones in backward (libtorch 2.x's zero_grad() sets them to none)
// would leave a DataParallel reading freed memory. Before each bucket's collective the model is
// listed again and the bucket follows its gradients to where they are now: pointer compares per
// step, and new tables only for a bucket whose storage moved. In backward, once per bucket
// launched, through what the model keeps for the step where it keeps something (model.hpp).
#pragma once

#include <gradsync/bucket/plan.hpp>
#include <gradsync/data_parallel/model_layout.hpp>
#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::all_of, std::fill
#include <cstddef>
#include <functional>  // for std::function
#include <vector>

namespace gradsync::inline v0::detail {

class StorageFollower {
public:
    // A new plan of `buckets` buckets.
    void reset(std::size_t buckets) {
        followed_.assign(buckets, 0);
        lister_ = nullptr;
    }
    void end_step() {
        std::fill(followed_.begin(), followed_.end(), 0);
        lister_ = nullptr;
    }

    // Follows the storage of buckets [first, last) not followed yet this step, with one listing
    // of the model (`in_backward`: a bucket launched while backward runs); moved(b) is called for
    // each bucket whose storage moved, to rebuild what points into it. where() begins error
    // messages. Returns whether it listed the model.
    template <class Model, class Moved, class Where>
    bool follow(Model& model, ModelLayout& layout, const BucketPlan& plan, std::size_t first, std::size_t last,
                bool in_backward, const Moved& moved, const Where& where) {
        const auto begin = followed_.begin();
        if (std::all_of(begin + first, begin + last, [](char f) { return f != 0; })) return false;
        // While backward runs, gradients not reached yet may be null; the model's lister for the
        // step (model.hpp) lists it again for each bucket launched after the first.
        if (in_backward && !lister_) lister_ = lister_for_step(model);
        const auto listed = layout.checked(in_backward ? lister_() : gradsync::parameters(model), where);
        for (std::size_t b = first; b < last; ++b) {
            if (followed_[b] != 0) continue;
            followed_[b] = 1;
            if (layout.follow(listed, plan.buckets[b].parameters, where)) moved(b);
        }
        return true;
    }

private:
    std::vector<char> followed_;                      // per bucket: followed this step
    std::function<std::vector<Parameter>()> lister_;  // this step's, once backward launched a bucket
};

}  // namespace gradsync::inline v0::detail
