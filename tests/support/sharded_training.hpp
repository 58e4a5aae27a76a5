// The example MLP trained three ways on the same batches, for the sharded equivalence tests:
// ShardedDataParallel on N ranks, DataParallel on N ranks, and one process on the whole batch;
// and the comparisons (bitwise, relative). ReleasingMlp is the MLP as a model that frees its
// gradients when told to and makes them again in backward (stage 2).
#pragma once

#include <gradsync/backend/local.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/sharded_optimizers.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

namespace sharded {

constexpr int steps = 12;
constexpr int micro_batch = 8;
constexpr std::uint64_t data_seed = 77;

using Weights = std::vector<std::vector<float>>;
inline Weights weights_of(const mlp::Mlp& m) { return {m.w1, m.b1, m.w2, m.b2}; }

inline mlp::Batch batch_of(int world, int rank, int step) {
    const int global = world * micro_batch;
    return mlp::make_batch(data_seed, static_cast<std::size_t>(step * global + rank * micro_batch), micro_batch);
}

inline bool bitwise_equal(const Weights& a, const Weights& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t t = 0; t < a.size(); ++t)
        if (a[t].size() != b[t].size() || std::memcmp(a[t].data(), b[t].data(), a[t].size() * sizeof(float)) != 0)
            return false;
    return true;
}

// ||a - b|| / ||b|| per tensor.
inline void check_close(const Weights& a, const Weights& b, double tolerance) {
    REQUIRE(a.size() == b.size());
    for (std::size_t t = 0; t < b.size(); ++t) {
        double diff = 0, norm = 0;
        for (std::size_t i = 0; i < b[t].size(); ++i) {
            const double d = double(a[t][i]) - double(b[t][i]);
            diff += d * d;
            norm += double(b[t][i]) * double(b[t][i]);
        }
        CAPTURE(t);
        CHECK(std::sqrt(diff) <= tolerance * std::sqrt(norm));
    }
}

// The MLP whose gradients are freed by release_gradients (their memory returned) and made again,
// as zeros, by the next backward or listing. Counts the releases and the gradient bytes it holds.
struct ReleasingMlp : mlp::Mlp {
    using mlp::Mlp::Mlp;
    std::size_t releases = 0;

    std::vector<gradsync::Parameter> parameters() {
        make_gradients();
        return mlp::Mlp::parameters();
    }
    // During backward: a released gradient not made again yet is null (listing must not make it).
    std::vector<gradsync::Parameter> parameters_now() {
        std::vector<gradsync::Parameter> out;
        const char* names[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
        std::vector<float>* values[] = {&w1, &b1, &w2, &b2};
        for (std::size_t k = 0; k < 4; ++k) {
            auto& g = *gradients()[k];
            out.push_back(
                gradsync::parameter(names[k], values[k]->data(), g.empty() ? nullptr : g.data(), values[k]->size()));
        }
        return out;
    }
    void release_gradients(std::span<const std::size_t> indices) {
        for (auto i : indices) {
            auto& g = *gradients()[i];
            g.clear();
            g.shrink_to_fit();
            ++releases;
        }
    }
    float forward_backward(const mlp::Batch& batch, float grad_scale = 1.0f, bool accumulate = false) {
        make_gradients();
        return mlp::Mlp::forward_backward(batch, grad_scale, accumulate);
    }
    [[nodiscard]] std::size_t gradient_bytes() {
        std::size_t n = 0;
        for (auto* g : gradients()) n += g->capacity() * sizeof(float);
        return n;
    }

private:
    std::vector<std::vector<float>*> gradients() { return {&gw1, &gb1, &gw2, &gb2}; }
    void make_gradients() {
        const std::size_t sizes[] = {w1.size(), b1.size(), w2.size(), b2.size()};
        for (std::size_t k = 0; k < 4; ++k)
            if (gradients()[k]->empty()) gradients()[k]->assign(sizes[k], 0.0f);
    }
};

// LocalBackend through its buffer calls only, as a backend that cannot reduce scattered memory:
// ShardedDataParallel reduces packed (a buffer per bucket for gradients and parameters).
struct BufferOnly {
    gradsync::LocalBackend& b;
    int rank() const { return b.rank(); }
    int size() const { return b.size(); }
    bool supports(gradsync::DType t) const { return b.supports(t); }
    void allreduce(gradsync::Buffer buf, gradsync::ReduceOp op) { b.allreduce(buf, op); }
    template <class T>
    void allreduce(std::span<T> s, gradsync::ReduceOp op) {
        b.allreduce(gradsync::buffer_of(s), op);
    }
    auto allreduce_async(gradsync::Buffer buf, gradsync::ReduceOp op) { return b.allreduce_async(buf, op); }
    void broadcast(std::span<std::byte> bytes, int root) { b.broadcast(bytes, root); }
    void barrier() { b.barrier(); }
    void reduce_scatter(gradsync::Buffer buf, gradsync::ReduceOp op) { b.reduce_scatter(buf, op); }
    auto reduce_scatter_async(gradsync::Buffer buf, gradsync::ReduceOp op) { return b.reduce_scatter_async(buf, op); }
    void all_gather(gradsync::Buffer buf) { b.all_gather(buf); }
    auto all_gather_async(gradsync::Buffer buf) { return b.all_gather_async(buf); }
};

// One rank's part of sharded training over `backend` (its rank and size give the batches): its
// weights after each step. The first `overlapping` ranks report gradients as backward makes them
// (grad_ready), so that their buckets' reduce_scatters start during backward; the others leave it
// all to step(). `state` and `total` get its state_elements() and parameter_elements().
template <bool Adam, class Model, class B, class... More>
std::vector<Weights> train_sharded_rank(B& backend, gradsync::SizeCappedBuckets caps, gradsync::ShardedOptions options,
                                        int overlapping, std::size_t& state, std::size_t& total, More... more) {
    std::vector<Weights> per_step;
    const auto r = static_cast<std::size_t>(backend.rank());
    Model model(/*seed=*/1 + r * 1000);  // replaced by rank 0's at construction
    gradsync::ShardedDataParallel sdp(model, backend, caps, options, more...);
    if (backend.rank() < overlapping) model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(i); };
    if (options.gather_behind_forward) model.before_read = [&](std::size_t i) { sdp.param_ready(i); };
    state = sdp.state_elements();
    total = sdp.parameter_elements();
    ShardedSgd sgd;
    ShardedAdam adam;
    sgd.velocity.assign(sdp.state_elements(), 0.0f);
    adam.m1.assign(sdp.state_elements(), 0.0f);
    adam.m2.assign(sdp.state_elements(), 0.0f);
    for (int s = 0; s < steps; ++s) {
        model.forward_backward(batch_of(backend.size(), backend.rank(), s));
        // Every bucket started during backward on the overlapping ranks, none on the others.
        CHECK(sdp.buckets_launched() == (backend.rank() < overlapping ? sdp.plan().buckets.size() : 0));
        gradsync::StepReport report;
        if constexpr (Adam)
            report = sdp.step(adam);
        else
            report = sdp.step(sgd);
        CHECK(report.applied);
        if (options.gather_behind_forward) sdp.wait_for_parameters();
        per_step.push_back(weights_of(model));
    }
    return per_step;
}

// Rank 0's weights after sharded training on `world` LocalBackend ranks; checks every rank ends
// every step with the same bits and keeps 1/world of the state. `Packed`: over BufferOnly (the
// buckets reduced as packed copies). `more`: further policies (a communication hook).
template <bool Adam, class Model, bool Packed, class... More>
Weights train_sharded_over(int world, gradsync::SizeCappedBuckets caps, gradsync::ShardedOptions options,
                           int overlapping, More... more) {
    std::vector<std::vector<Weights>> per_step(static_cast<std::size_t>(world));
    std::vector<std::size_t> state(static_cast<std::size_t>(world));
    std::size_t total = 0;
    gradsync::spawn(world, [&](gradsync::LocalBackend& local) {
        BufferOnly packed{local};
        auto& backend = [&]() -> auto& {
            if constexpr (Packed)
                return packed;
            else
                return local;
        }
        ();
        const auto r = static_cast<std::size_t>(backend.rank());
        std::size_t elements = 0;
        per_step[r] = train_sharded_rank<Adam, Model>(backend, caps, options, overlapping, state[r], elements, more...);
        if (r == 0) total = elements;
    });
    for (const auto& w : per_step) CHECK(w == per_step[0]);  // float ==: bitwise here (no NaN)
    std::size_t sum = 0;
    for (auto n : state) {
        sum += n;
        // 1/N of every bucket, each shard at most one element longer than an even share.
        CHECK(n * static_cast<std::size_t>(world) <= total + static_cast<std::size_t>(world) * 8);
    }
    CHECK(sum == total);
    return per_step[0].back();
}

template <bool Adam, class Model = mlp::Mlp, class... More>
Weights train_sharded(int world, gradsync::SizeCappedBuckets caps, gradsync::ShardedOptions options = {},
                      int overlapping = 0, More... more) {
    return train_sharded_over<Adam, Model, false>(world, caps, options, overlapping, more...);
}

// One rank's part of DataParallel training on the same batches, the example's own optimizers: its
// final weights. `more`: further policies (a communication hook).
template <bool Adam, class B, class... More>
Weights train_unsharded_rank(B& backend, gradsync::SizeCappedBuckets caps, double clip, More... more) {
    mlp::Mlp model(/*seed=*/1 + static_cast<std::uint64_t>(backend.rank()) * 1000);
    gradsync::DataParallel dp(model, backend, caps, gradsync::Options{.clip_norm = clip}, more...);
    mlp::Sgd sgd(0.05f, 0.9f);
    mlp::Adam adam(1e-3f);
    for (int s = 0; s < steps; ++s) {
        model.forward_backward(batch_of(backend.size(), backend.rank(), s));
        (void)dp.step([&] {
            if constexpr (Adam)
                adam.step(model);
            else
                sgd.step(model);
        });
    }
    return weights_of(model);
}

// Rank 0's weights after DataParallel on `world` LocalBackend ranks.
template <bool Adam, class... More>
Weights train_unsharded(int world, gradsync::SizeCappedBuckets caps, double clip = 0, More... more) {
    Weights result;
    gradsync::spawn(world, [&](gradsync::LocalBackend& backend) {
        auto mine = train_unsharded_rank<Adam>(backend, caps, clip, more...);
        if (backend.rank() == 0) result = std::move(mine);
    });
    return result;
}

template <bool Adam>
Weights train_single(int world) {
    mlp::Mlp model(/*seed=*/1);
    mlp::Sgd sgd(0.05f, 0.9f);
    mlp::Adam adam(1e-3f);
    for (int s = 0; s < steps; ++s) {
        model.forward_backward(
            mlp::make_batch(data_seed, static_cast<std::size_t>(s * world * micro_batch), world * micro_batch));
        if constexpr (Adam)
            adam.step(model);
        else
            sgd.step(model);
    }
    return weights_of(model);
}

}  // namespace sharded
