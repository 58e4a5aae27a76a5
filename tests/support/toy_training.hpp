// Three steps of rank-dependent integer gradients on a Toy model of 300, 5 and 4000 weights,
// made ready in backward's order, through DataParallel or ShardedDataParallel over any backend.
// The sums are exact, so every backend that averages correctly ends with the same weights bit
// for bit: a test compares a backend's result with LocalBackend's.
#pragma once

#include <gradsync/bytes.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include "support/toy_model.hpp"

#include <cstddef>
#include <span>
#include <vector>

namespace testing_support {

inline void set_toy_gradients(Toy::Tensor& t, std::size_t i, int rank, int step) {
    for (std::size_t k = 0; k < t.g.size(); ++k) t.g[k] = float((k + i) % 7) + float(rank * (step + 1));
}

inline std::vector<float> toy_weights(const Toy& model) {
    std::vector<float> out;
    for (const auto& t : model.tensors) out.insert(out.end(), t.w.begin(), t.w.end());
    return out;
}

// Rank `backend.rank()`'s weights after three DataParallel steps (buckets of 4 KiB).
template <class Backend>
std::vector<float> train_toy(Backend& backend) {
    Toy model({300, 5, 4000}, 1.0f);
    gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{4096}});
    for (int step = 0; step < 3; ++step) {
        for (std::size_t i = model.tensors.size(); i-- > 0;) {
            set_toy_gradients(model.tensors[i], i, backend.rank(), step);
            dp.grad_ready(i);
        }
        dp.step([&] {
            for (auto& t : model.tensors)
                for (std::size_t k = 0; k < t.w.size(); ++k) t.w[k] -= 0.125f * t.g[k];
        });
    }
    return toy_weights(model);
}

// ...and after three ShardedDataParallel steps, each of which must apply.
template <class Backend>
std::vector<float> train_toy_sharded(Backend& backend) {
    Toy model({300, 5, 4000}, 1.0f);
    gradsync::ShardedDataParallel sdp(model, backend, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{4096}});
    for (int step = 0; step < 3; ++step) {
        for (std::size_t i = model.tensors.size(); i-- > 0;) {
            set_toy_gradients(model.tensors[i], i, backend.rank(), step);
            sdp.grad_ready(i);
        }
        const bool applied = sdp.step([](std::span<const gradsync::ShardPiece<float>> pieces) {
                                    for (const auto& piece : pieces)
                                        for (std::size_t k = 0; k < piece.params.size(); ++k)
                                            piece.params[k] -= 0.125f * piece.grads[k];
                                })
                                 .applied;
        if (!applied) return {};  // the caller's comparison fails
    }
    return toy_weights(model);
}

}  // namespace testing_support
