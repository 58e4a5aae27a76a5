// The core ShardedDataParallel derives from: FrontCore (front_core.hpp) over a bucket engine that
// reduce-scatters each bucket in float32 through the memory policy (host or device memory), where
// the gradients lie when the backend takes scattered memory (ScatteredShardedCollectives), else
// packed.
#pragma once

#include <gradsync/backend/concept_checks.hpp>
#include <gradsync/backend/concepts.hpp>
#include <gradsync/data_parallel/bucket_engine.hpp>
#include <gradsync/data_parallel/front_core.hpp>
#include <gradsync/data_parallel/sharded_options.hpp>
#include <gradsync/data_parallel/sharded_policies.hpp>
#include <gradsync/dtype.hpp>

namespace gradsync::inline v0::detail {

// The backend is checked first, so that a type that is not one reads that before anything else.
template <class Front, class Model, class BackendT, class... Policies>
struct ShardedCoreOf {
    static_assert(check_backend<BackendT>());
    using Set = ShardedPolicySet<Policies...>;
    static constexpr bool in_place = ScatteredShardedCollectives<BackendT>;
    using memory = typename Set::memory;  // the gradients', the shards' and the buckets'
    using engine = BucketEngine<BackendT, memory, DType::float32, in_place, typename Set::comm_hook,
                                BucketCollective::reduce_scatter>;
    using type =
        FrontCore<Front, Model, BackendT, engine, ShardedOptions, typename Set::loss_scaler, typename Set::metrics>;
};

}  // namespace gradsync::inline v0::detail
