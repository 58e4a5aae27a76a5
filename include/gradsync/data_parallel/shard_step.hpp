// What ShardedDataParallel's step decides over this rank's shards with the other ranks: the global
// norm and whether every averaged gradient is finite (one small allreduce), which parameters
// overflowed when one is not, and clipping. Each collective carries its tag.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/data_parallel/shard_layout.hpp>
#include <gradsync/detail/host_passes.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/model/model.hpp>

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <utility>  // for std::declval
#include <vector>

namespace gradsync::inline v0::detail {

// What a bucket's asynchronous reduce_scatter returns: over segments where they lie, or packed.
template <class B, bool InPlace>
struct ShardedHandle {
    using type = decltype(reduce_scatter_async_tagged(std::declval<B&>(), std::declval<Buffer>(), ReduceOp::average,
                                                      CollectiveTag{}));
};
template <class B>
struct ShardedHandle<B, true> {
    using type = decltype(reduce_scatter_async_tagged(std::declval<B&>(), std::declval<std::span<const Segment>>(),
                                                      DType::float32, ReduceOp::average, CollectiveTag{}));
};

struct ShardVerdict {
    double norm = 0;  // not finite when a gradient is not
    bool finite = true;
};

// Unscales this rank's shards by `unscale` (1: leaves them) while summing their squares, then
// agrees with every rank on the norm and the finite check (the square sum is non-finite exactly
// when an element is).
template <Backend B>
ShardVerdict agree_on_shards(B& backend, std::span<const std::span<float>> grads, double unscale, CollectiveTag tag) {
    SquareSum squares;
    for (const auto g : grads) {
        if (unscale == 1.0)
            square_sum(g.data(), g.size(), squares);
        else
            scale_square_sum(g.data(), g.size(), unscale, squares);
    }
    const double mine = squares.total();
    double partial[2] = {std::isfinite(mine) ? mine : 0.0, std::isfinite(mine) ? 0.0 : 1.0};
    if (backend.size() > 1) allreduce_tagged(backend, Buffer{partial, 2, DType::float64}, ReduceOp::sum, tag);
    if (partial[1] > 0) return {std::nan(""), false};
    return {std::sqrt(partial[0]), true};
}

// After an overflow, which every rank agreed on: the parameters with a non-finite averaged
// gradient in any rank's pieces, named alike on every rank (one allreduce of a flag each).
template <Backend B>
std::vector<std::string> overflowed_parameters(B& backend, std::span<const ShardPiece<float>> pieces,
                                               std::span<const Parameter> params, CollectiveTag tag) {
    std::vector<float> flags(params.size(), 0.0f);
    for (const auto& piece : pieces) {
        SquareSum squares;
        square_sum(piece.grads.data(), piece.grads.size(), squares);
        if (!std::isfinite(squares.total())) flags[piece.parameter] = 1.0f;
    }
    if (backend.size() > 1)
        allreduce_tagged(backend, Buffer{flags.data(), flags.size(), DType::float32}, ReduceOp::sum, tag);
    std::vector<std::string> names;
    for (std::size_t p = 0; p < flags.size(); ++p)
        if (flags[p] > 0) names.push_back(params[p].name);
    return names;
}

// Scales this rank's shards down so that the global norm `norm` becomes `clip_norm`.
inline void clip_shards(std::span<const std::span<float>> grads, double norm, double clip_norm) {
    for (const auto g : grads) scale_only(g.data(), g.size(), clip_norm / (norm + 1e-6));
}

}  // namespace gradsync::inline v0::detail
