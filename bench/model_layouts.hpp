// Gradient layouts of real networks, generated from their architectures' shape rules, so that
// benchmarks and tests can exercise DataParallel without a model behind the tensors.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace layouts {

struct Tensor {
    std::string name;
    std::size_t count;
    std::vector<std::size_t> shape{};  // as the framework holds it
};

// torchvision's ResNet-50: 161 tensors, 25,557,032 parameters, in registration order.
inline std::vector<Tensor> resnet50() {
    std::vector<Tensor> t;
    auto conv = [&](const std::string& name, std::size_t out, std::size_t in, std::size_t k) {
        t.push_back({name + ".weight", out * in * k * k, {out, in, k, k}});
    };
    auto bn = [&](const std::string& name, std::size_t c) {
        t.push_back({name + ".weight", c, {c}});
        t.push_back({name + ".bias", c, {c}});
    };
    conv("conv1", 64, 3, 7);
    bn("bn1", 64);
    const std::size_t blocks[] = {3, 4, 6, 3};
    std::size_t in = 64;
    for (std::size_t layer = 0; layer < 4; ++layer) {
        std::size_t width = 64u << layer, out = width * 4;
        for (std::size_t b = 0; b < blocks[layer]; ++b) {
            std::string p = "layer" + std::to_string(layer + 1) + "." + std::to_string(b);
            conv(p + ".conv1", width, in, 1);
            bn(p + ".bn1", width);
            conv(p + ".conv2", width, width, 3);
            bn(p + ".bn2", width);
            conv(p + ".conv3", out, width, 1);
            bn(p + ".bn3", out);
            if (b == 0) {
                conv(p + ".downsample.0", out, in, 1);
                bn(p + ".downsample.1", out);
            }
            in = out;
        }
    }
    t.push_back({"fc.weight", 1000 * 2048, {1000, 2048}});
    t.push_back({"fc.bias", 1000, {1000}});
    return t;
}

// Hugging Face's bert-base-uncased BertModel: 199 tensors, 109,482,240 parameters.
inline std::vector<Tensor> bert_base() {
    const std::size_t hidden = 768, ffn = 3072, vocab = 30522, positions = 512, types = 2;
    std::vector<Tensor> t;
    auto dense = [&](const std::string& name, std::size_t out, std::size_t in) {
        t.push_back({name + ".weight", out * in, {out, in}});
        t.push_back({name + ".bias", out, {out}});
    };
    auto norm = [&](const std::string& name) {
        t.push_back({name + ".weight", hidden, {hidden}});
        t.push_back({name + ".bias", hidden, {hidden}});
    };
    t.push_back({"embeddings.word_embeddings.weight", vocab * hidden, {vocab, hidden}});
    t.push_back({"embeddings.position_embeddings.weight", positions * hidden, {positions, hidden}});
    t.push_back({"embeddings.token_type_embeddings.weight", types * hidden, {types, hidden}});
    norm("embeddings.LayerNorm");
    for (int layer = 0; layer < 12; ++layer) {
        std::string p = "encoder.layer." + std::to_string(layer);
        dense(p + ".attention.self.query", hidden, hidden);
        dense(p + ".attention.self.key", hidden, hidden);
        dense(p + ".attention.self.value", hidden, hidden);
        dense(p + ".attention.output.dense", hidden, hidden);
        norm(p + ".attention.output.LayerNorm");
        dense(p + ".intermediate.dense", ffn, hidden);
        dense(p + ".output.dense", hidden, ffn);
        norm(p + ".output.LayerNorm");
    }
    dense("pooler.dense", hidden, hidden);
    return t;
}

inline std::size_t total_count(const std::vector<Tensor>& tensors) {
    std::size_t n = 0;
    for (const auto& t : tensors) n += t.count;
    return n;
}

}  // namespace layouts
