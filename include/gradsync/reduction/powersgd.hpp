// PowerSGD (Vogels, Karimireddy and Jaggi, 2019), a communication hook: each weight matrix M
// (n x m, from its parameter's shape: the first dimension by the rest) is averaged as a rank-r
// approximation P Q^T, so (n + m) r values travel instead of n m. One power iteration per step:
// P = M Q is summed over the ranks and orthonormalized, Q = M^T P is summed, and every rank sets
// its gradient to P Q^T / world, the same on every rank. Error feedback adds what the
// approximation left out of this rank's gradient to its next one; warm start begins each step's
// iteration from the last step's Q. Vectors (biases), parameters without a shape, and matrices
// too small to gain are averaged exactly, in one allreduce per bucket.
#pragma once

#include <gradsync/reduction/comm_hook.hpp>
#include <gradsync/reduction/powersgd_config.hpp>

#include <algorithm>  // for std::copy, std::copy_n, std::fill
#include <cmath>      // for std::sqrt, std::isfinite
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0 {

class PowerSGD {
public:
    using policy_category = policy_category::comm_hook;
    static constexpr bool hooked = true;

    using Config = PowerSGDConfig;
    using MatrixState = PowerSGDState;

    PowerSGD() = default;
    explicit PowerSGD(Config config) : config_(config) {}

    [[nodiscard]] std::string settings() const { return detail::powersgd_settings(config_); }
    [[nodiscard]] std::string invalid() const { return detail::powersgd_invalid(config_); }
    [[nodiscard]] const Config& config() const { return config_; }

    // The state of each compressed parameter, by name: to save it with a checkpoint or restore it.
    [[nodiscard]] std::map<std::string, MatrixState>& state() { return state_; }
    [[nodiscard]] const std::map<std::string, MatrixState>& state() const { return state_; }
    // Where each matrix's state lies, by parameter name (Checkpoint::add(hook) saves it).
    [[nodiscard]] std::map<std::string, PowerSGDArrays> state_arrays() {
        std::map<std::string, PowerSGDArrays> out;
        for (auto& [name, st] : state_) out[name] = {std::span(st.error), std::span(st.q)};
        return out;
    }
    // Elements this rank handed to collectives since construction, and the elements of the
    // buckets it reduced (what plain allreduces would have moved).
    [[nodiscard]] std::uint64_t elements_sent() const { return sent_; }
    [[nodiscard]] std::uint64_t elements_reduced() const { return reduced_; }

    // Makes the state of every matrix among `parameters` (the engine calls it when it plans the
    // buckets), so that a checkpoint can restore it before the first step.
    void prepare(std::span<const HookParameter> parameters) {
        for (const auto& p : parameters)
            if (const auto shape = detail::powersgd_shape(config_, p)) make_state(p.name, *shape, 0);
    }

    HookComm::Pending start(const HookBucket& bucket, HookComm& comm) {
        auto& w = work_[bucket.index];
        w = {};
        for (const auto& p : bucket.parameters) {
            const auto shape = detail::powersgd_shape(config_, p);
            if (!shape) {
                w.exact.push_back(&p);
                w.flat.insert(w.flat.end(), bucket.values.begin() + static_cast<std::ptrdiff_t>(p.offset),
                              bucket.values.begin() + static_cast<std::ptrdiff_t>(p.offset + p.count));
                continue;
            }
            Matrix mx{&p, shape->n, shape->m, shape->r, w.ps.size(), w.qs.size()};
            w.ps.resize(w.ps.size() + mx.n * mx.r);
            w.qs.resize(w.qs.size() + mx.m * mx.r);
            begin_matrix(mx, bucket, w, comm);
            w.matrices.push_back(mx);
        }
        reduced_ += bucket.values.size();
        sent_ += w.ps.size() + w.flat.size();
        HookComm::Pending pending;
        if (!w.ps.empty()) pending = comm.allreduce_async(w.ps, ReduceOp::sum);
        if (!w.flat.empty()) pending.join(comm.allreduce_async(w.flat, ReduceOp::average));
        return pending;
    }

    void finish(const HookBucket& bucket, HookComm& comm) {
        auto& w = work_[bucket.index];
        std::size_t at = 0;
        for (const auto* p : w.exact) {
            std::copy_n(w.flat.begin() + static_cast<std::ptrdiff_t>(at), p->count,
                        bucket.values.begin() + static_cast<std::ptrdiff_t>(p->offset));
            at += p->count;
        }
        if (w.matrices.empty()) return;
        // Every rank holds the same sums, so every rank takes the same branch.
        if (!all_finite(w.ps)) return give_up(bucket, w);
        for (const auto& mx : w.matrices) orthonormalize(std::span<float>(w.ps).subspan(mx.p_at, mx.n * mx.r), mx);
        for (const auto& mx : w.matrices) project(mx, bucket, w);
        sent_ += w.qs.size();
        comm.allreduce(w.qs, ReduceOp::sum);
        if (!all_finite(w.qs)) return give_up(bucket, w);
        for (const auto& mx : w.matrices) approximate(mx, bucket, w, comm.size());
    }

private:
    using Shape = detail::LowRankShape;
    struct Matrix {
        const HookParameter* param;
        std::size_t n, m, r;
        std::size_t p_at, q_at;  // where its P and Q lie in the bucket's work arrays, transposed
    };
    struct Work {
        std::vector<float> ps, qs, flat;  // every matrix's P and Q, the exact parameters' values
        std::vector<Matrix> matrices;
        std::vector<const HookParameter*> exact;
    };

    // A matrix's state, made when missing: the error zero, the first Q drawn from the seed (and
    // drawn again every step without warm start).
    MatrixState& make_state(const std::string& name, const Shape& shape, std::int64_t step) {
        auto& st = state_[name];
        if (config_.error_feedback && st.error.size() != shape.n * shape.m) st.error.assign(shape.n * shape.m, 0.0f);
        if (!config_.warm_start || st.q.size() != shape.m * shape.r) {
            st.q.resize(shape.m * shape.r);
            const std::uint64_t key = detail::powersgd_key(config_, name) ^ detail::powersgd_step_key(config_, step);
            for (std::size_t i = 0; i < st.q.size(); ++i) st.q[i] = detail::powersgd_uniform(key, i);
        }
        return st;
    }

    static float* values_of(const HookBucket& bucket, const HookParameter& p) {
        return bucket.values.data() + p.offset;
    }

    // Adds the error carried from the last step, picks Q, and computes this rank's P = M Q, in
    // one pass over M.
    void begin_matrix(const Matrix& mx, const HookBucket& bucket, Work& w, const HookComm&) {
        auto& st = make_state(mx.param->name, Shape{mx.n, mx.m, mx.r}, bucket.step);
        float* M = values_of(bucket, *mx.param);
        const bool feedback = config_.error_feedback;
        float* Pt = w.ps.data() + mx.p_at;
        for (std::size_t i = 0; i < mx.n; ++i) {
            float* row = M + i * mx.m;
            if (feedback) axpy(row, st.error.data() + i * mx.m, bucket.loss_scale, mx.m);
            for (std::size_t k = 0; k < mx.r; ++k) Pt[k * mx.n + i] = dot(row, st.q.data() + k * mx.m, mx.m);
        }
    }

    // P's columns made orthonormal (Gram-Schmidt, twice, in double); a column that vanishes is
    // left zero.
    static void orthonormalize(std::span<float> Pt, const Matrix& mx) {
        std::vector<double> col(mx.n);
        for (std::size_t k = 0; k < mx.r; ++k) {
            for (std::size_t i = 0; i < mx.n; ++i) col[i] = Pt[k * mx.n + i];
            for (int pass = 0; pass < 2; ++pass)
                for (std::size_t c = 0; c < k; ++c) {
                    const float* other = Pt.data() + c * mx.n;
                    double dot = 0;
                    for (std::size_t i = 0; i < mx.n; ++i) dot += col[i] * other[i];
                    for (std::size_t i = 0; i < mx.n; ++i) col[i] -= dot * other[i];
                }
            double norm = 0;
            for (double v : col) norm += v * v;
            norm = std::sqrt(norm);
            for (std::size_t i = 0; i < mx.n; ++i)
                Pt[k * mx.n + i] = norm > 0 ? static_cast<float>(col[i] / norm) : 0.0f;
        }
    }

    // This rank's Q = M^T P, in one pass over M.
    static void project(const Matrix& mx, const HookBucket& bucket, Work& w) {
        const float* M = values_of(bucket, *mx.param);
        const float* Pt = w.ps.data() + mx.p_at;
        float* Qt = w.qs.data() + mx.q_at;
        std::fill(Qt, Qt + mx.m * mx.r, 0.0f);
        for (std::size_t i = 0; i < mx.n; ++i)
            for (std::size_t k = 0; k < mx.r; ++k) axpy(Qt + k * mx.m, M + i * mx.m, Pt[k * mx.n + i], mx.m);
    }

    // The gradient becomes P Q^T / world; the error keeps what that left out of this rank's. One
    // pass over M.
    void approximate(const Matrix& mx, const HookBucket& bucket, const Work& w, int world) {
        auto& st = state_[mx.param->name];
        float* M = values_of(bucket, *mx.param);
        const float* Pt = w.ps.data() + mx.p_at;
        const float* Qt = w.qs.data() + mx.q_at;
        const float unscale = 1.0f / bucket.loss_scale;
        const float share = 1.0f / static_cast<float>(world);
        std::vector<float> approx(mx.m);
        for (std::size_t i = 0; i < mx.n; ++i) {
            std::fill(approx.begin(), approx.end(), 0.0f);
            for (std::size_t k = 0; k < mx.r; ++k) axpy(approx.data(), Qt + k * mx.m, Pt[k * mx.n + i] * share, mx.m);
            float* row = M + i * mx.m;
            if (config_.error_feedback) {
                float* error = st.error.data() + i * mx.m;
                for (std::size_t j = 0; j < mx.m; ++j) error[j] = (row[j] - approx[j]) * unscale;
            }
            std::copy(approx.begin(), approx.end(), row);
        }
        if (config_.warm_start) st.q.assign(Qt, Qt + mx.m * mx.r);
    }

    // y += a x, over n elements.
    static void axpy(float* __restrict y, const float* __restrict x, float a, std::size_t n) {
        for (std::size_t j = 0; j < n; ++j) y[j] += a * x[j];
    }
    // The sum of a[j] b[j], in eight interleaved partial sums (the same order on every rank).
    static float dot(const float* a, const float* b, std::size_t n) {
        float part[8] = {};
        std::size_t j = 0;
        for (; j + 8 <= n; j += 8)
            for (std::size_t l = 0; l < 8; ++l) part[l] += a[j + l] * b[j + l];
        float tail = 0;
        for (; j < n; ++j) tail += a[j] * b[j];
        return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7])) + tail;
    }

    // A sum that is not finite (a rank's gradients overflowed): the matrices' gradients are left
    // not finite, so that a step measuring them skips; the error and Q stay as they were.
    void give_up(const HookBucket& bucket, const Work& w) {
        for (const auto& mx : w.matrices) {
            float* M = values_of(bucket, *mx.param);
            std::fill(M, M + mx.n * mx.m, std::numeric_limits<float>::quiet_NaN());
        }
    }

    // Whether every value is finite.
    static bool all_finite(std::span<const float> v) {
        for (float x : v)
            if (!std::isfinite(x)) return false;
        return true;
    }

    Config config_;
    std::map<std::string, MatrixState> state_;
    std::map<std::size_t, Work> work_;  // by bucket, within a step
    std::uint64_t sent_ = 0, reduced_ = 0;
};

}  // namespace gradsync::inline v0
