// A small trainer's model: the 784-512-10 MLP of the PaddlePaddle manual's train script (ReLU,
// softmax cross-entropy), with plain loops, synthetic MNIST-shaped data and two optimizers.
// Weights and gradients are std::vector<float>; parameters() is the one line of gradsync glue.
#pragma once

#include <gradsync/model/model.hpp>

#include <algorithm>  // for std::max_element, std::fill
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>  // for std::function
#include <span>
#include <vector>

namespace mlp {

// Deterministic random numbers that do not depend on the standard library's distributions.
inline std::uint64_t mix(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
inline float uniform(std::uint64_t key) {  // in [0, 1)
    return static_cast<float>(mix(key) >> 40) * (1.0f / 16777216.0f);
}

struct Batch {
    std::vector<float> images;  // size x 784
    std::vector<int> labels;    // size
    int size = 0;
};

// Sample i of an endless synthetic dataset: one noisy prototype image per class.
inline Batch make_batch(std::uint64_t seed, std::size_t first, int size) {
    Batch b;
    b.size = size;
    b.images.resize(static_cast<std::size_t>(size) * 784);
    b.labels.resize(static_cast<std::size_t>(size));
    for (int s = 0; s < size; ++s) {
        std::uint64_t index = first + static_cast<std::size_t>(s);
        int label = static_cast<int>(mix(seed ^ (index * 7919)) % 10);
        b.labels[static_cast<std::size_t>(s)] = label;
        for (std::size_t p = 0; p < 784; ++p) {
            float prototype = uniform(seed * 31 + static_cast<std::uint64_t>(label) * 784 + p) > 0.7f ? 1.0f : 0.0f;
            float noise = uniform(seed ^ (index * 1000003 + p));
            b.images[static_cast<std::size_t>(s) * 784 + p] = 0.3f * prototype + noise;
        }
    }
    return b;
}

class Mlp {
public:
    static constexpr std::size_t in = 784, hidden = 512, out = 10;

    explicit Mlp(std::uint64_t seed)
        : w1(in * hidden),
          b1(hidden),
          w2(hidden * out),
          b2(out),
          gw1(w1.size()),
          gb1(b1.size()),
          gw2(w2.size()),
          gb2(b2.size()) {
        auto init = [seed](std::vector<float>& w, float scale, std::uint64_t salt) {
            for (std::size_t i = 0; i < w.size(); ++i)
                w[i] = (uniform(seed * 97 + salt * 1000003 + i) - 0.5f) * 2 * scale;
        };
        init(w1, 1.0f / std::sqrt(float(in)), 1);
        init(w2, 1.0f / std::sqrt(float(hidden)), 2);
    }

    // Forward and backward over one batch. Fills the gradients with the mean over the batch times
    // `grad_scale` (added to them when `accumulate`), layer by layer from the last, calling
    // on_grad_ready(i) as parameter i's gradient becomes final. Returns the mean loss.
    float forward_backward(const Batch& batch, float grad_scale = 1.0f, bool accumulate = false) {
        if (before_read)
            for (std::size_t index = 0; index < 4; ++index) before_read(index);
        const auto n = static_cast<std::size_t>(batch.size);
        h_.assign(n * hidden, 0.0f);
        std::vector<float> dlogits(n * out), dh(hidden);
        float loss = 0;
        for (std::size_t s = 0; s < n; ++s) {
            const float* x = &batch.images[s * in];
            float* h = &h_[s * hidden];
            for (std::size_t j = 0; j < hidden; ++j) h[j] = b1[j];
            for (std::size_t i = 0; i < in; ++i) {
                const float xi = x[i];
                const float* row = &w1[i * hidden];
                for (std::size_t j = 0; j < hidden; ++j) h[j] += xi * row[j];
            }
            for (std::size_t j = 0; j < hidden; ++j) h[j] = std::max(h[j], 0.0f);
            float logits[out];
            for (std::size_t k = 0; k < out; ++k) logits[k] = b2[k];
            for (std::size_t j = 0; j < hidden; ++j)
                for (std::size_t k = 0; k < out; ++k) logits[k] += h[j] * w2[j * out + k];
            float top = *std::max_element(logits, logits + out), sum = 0;
            for (float& l : logits) sum += (l = std::exp(l - top));
            const auto label = static_cast<std::size_t>(batch.labels[s]);
            loss -= std::log(logits[label] / sum);
            for (std::size_t k = 0; k < out; ++k)
                dlogits[s * out + k] = (logits[k] / sum - (k == label ? 1.0f : 0.0f)) * grad_scale / float(n);
        }
        if (!accumulate)
            for (auto* g : {&gw1, &gb1, &gw2, &gb2}) std::fill(g->begin(), g->end(), 0.0f);
        // Layer 2 first, as backward goes.
        for (std::size_t s = 0; s < n; ++s) {
            const float* h = &h_[s * hidden];
            const float* dl = &dlogits[s * out];
            for (std::size_t k = 0; k < out; ++k) gb2[k] += dl[k];
            for (std::size_t j = 0; j < hidden; ++j)
                for (std::size_t k = 0; k < out; ++k) gw2[j * out + k] += h[j] * dl[k];
        }
        notify(3);  // fc2.bias
        notify(2);  // fc2.weight
        for (std::size_t s = 0; s < n; ++s) {
            const float* x = &batch.images[s * in];
            const float* h = &h_[s * hidden];
            const float* dl = &dlogits[s * out];
            for (std::size_t j = 0; j < hidden; ++j) {
                float d = 0;
                for (std::size_t k = 0; k < out; ++k) d += w2[j * out + k] * dl[k];
                dh[j] = h[j] > 0 ? d : 0.0f;
                gb1[j] += dh[j];
            }
            for (std::size_t i = 0; i < in; ++i) {
                const float xi = x[i];
                float* row = &gw1[i * hidden];
                for (std::size_t j = 0; j < hidden; ++j) row[j] += xi * dh[j];
            }
        }
        notify(1);  // fc1.bias
        notify(0);  // fc1.weight
        return loss / float(n);
    }

    // Called with a parameter's index (its position in parameters()) when its gradient is final.
    std::function<void(std::size_t)> on_grad_ready;
    // Called with each parameter's index, in forward order, before the forward reads it.
    std::function<void(std::size_t)> before_read;

    // What gradsync needs to know: each tensor's name, values and gradient (and a weight's shape).
    std::vector<gradsync::Parameter> parameters() {
        return {gradsync::parameter("fc1.weight", w1, gw1, {in, hidden}), gradsync::parameter("fc1.bias", b1, gb1),
                gradsync::parameter("fc2.weight", w2, gw2, {hidden, out}), gradsync::parameter("fc2.bias", b2, gb2)};
    }

    std::vector<float> w1, b1, w2, b2;      // values
    std::vector<float> gw1, gb1, gw2, gb2;  // gradients

private:
    void notify(std::size_t index) {
        if (on_grad_ready) on_grad_ready(index);
    }
    std::vector<float> h_;
};

// SGD with momentum: v = momentum * v + g; w -= lr * v.
class Sgd {
public:
    Sgd(float lr, float momentum) : lr_(lr), momentum_(momentum) {}
    // A step at another learning rate, such as a scaled or warming-up one.
    void step(Mlp& m, float lr) {
        lr_ = lr;
        step(m);
    }
    // The momentum buffers, one per parameter, sized for `m` (for a checkpoint to save or load).
    std::vector<std::vector<float>>& velocity(Mlp& m) {
        auto params = m.parameters();
        velocity_.resize(params.size());
        for (std::size_t p = 0; p < params.size(); ++p) velocity_[p].resize(params[p].count, 0.0f);
        return velocity_;
    }
    void step(Mlp& m) {
        auto params = m.parameters();
        velocity_.resize(params.size());
        for (std::size_t p = 0; p < params.size(); ++p) {
            auto* w = static_cast<float*>(params[p].data);
            auto* g = static_cast<const float*>(params[p].grad);
            auto& v = velocity_[p];
            v.resize(params[p].count, 0.0f);
            for (std::size_t i = 0; i < v.size(); ++i) {
                v[i] = momentum_ * v[i] + g[i];
                w[i] -= lr_ * v[i];
            }
        }
    }

private:
    float lr_, momentum_;
    std::vector<std::vector<float>> velocity_;
};

// Adam (Kingma and Ba) with bias correction.
class Adam {
public:
    explicit Adam(float lr, float beta1 = 0.9f, float beta2 = 0.999f, float eps = 1e-8f)
        : lr_(lr), beta1_(beta1), beta2_(beta2), eps_(eps) {}
    void step(Mlp& m) {
        auto params = m.parameters();
        m1_.resize(params.size());
        m2_.resize(params.size());
        ++t_;
        const float c1 = 1 - std::pow(beta1_, float(t_)), c2 = 1 - std::pow(beta2_, float(t_));
        for (std::size_t p = 0; p < params.size(); ++p) {
            auto* w = static_cast<float*>(params[p].data);
            auto* g = static_cast<const float*>(params[p].grad);
            m1_[p].resize(params[p].count, 0.0f);
            m2_[p].resize(params[p].count, 0.0f);
            for (std::size_t i = 0; i < params[p].count; ++i) {
                m1_[p][i] = beta1_ * m1_[p][i] + (1 - beta1_) * g[i];
                m2_[p][i] = beta2_ * m2_[p][i] + (1 - beta2_) * g[i] * g[i];
                w[i] -= lr_ * (m1_[p][i] / c1) / (std::sqrt(m2_[p][i] / c2) + eps_);
            }
        }
    }

private:
    float lr_, beta1_, beta2_, eps_;
    int t_ = 0;
    std::vector<std::vector<float>> m1_, m2_;
};

}  // namespace mlp
