// Checkpoints that other tools read as a state dict: every tensor saved with the shape the model
// states (a 0-d tensor as 0-d), a saved shape that contradicts the model's refused, checkpoints of
// the previous version (every tensor 1-D) still loaded, and load_weights: parameters and buffers
// from any safetensors file with the model's names, such as one Python wrote from a state dict.
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "support/shaped_model.hpp"
#include "support/temp_dir.hpp"

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

using testing_support::Shaped;

namespace {

// Written by gradsync before tensors had shapes in its checkpoints (every tensor 1-D): a Shaped(3)
// at step 5 with "opt.momentum" = {1.5, -2, 0.25, 8}.
const std::filesystem::path one_dimensional =
    std::filesystem::path(__FILE__).parent_path() / "data" / "checkpoint_1d.safetensors";

std::vector<std::uint64_t> shape_of(const gradsync::SafetensorsFile& file, const std::string& name) {
    const auto* t = file.find(name);
    REQUIRE(t != nullptr);
    return t->shape;
}

template <class T>
gradsync::TensorBytes tensor(const std::string& name, const std::vector<T>& v, std::vector<std::uint64_t> shape) {
    return {name, gradsync::dtype_of<T>, std::move(shape), std::as_bytes(std::span(v))};
}

// A state dict of Shaped(`seed`) as Python's safetensors writes one: the framework's names and
// shapes, no gradsync metadata. `weight_shape` lets a test contradict the model.
void write_state_dict(const std::filesystem::path& path, const Shaped& m,
                      std::vector<std::uint64_t> weight_shape = {2, 3}, bool extra = false) {
    std::vector<gradsync::TensorBytes> tensors{tensor("layer.weight", m.weight, std::move(weight_shape)),
                                               tensor("layer.bias", m.bias, {3}), tensor("scale", m.scale, {}),
                                               tensor("bn.running_mean", m.running_mean, {3}),
                                               tensor("bn.num_batches_tracked", m.batches, {})};
    const std::vector<float> stray(2, 1.0f);
    if (extra) tensors.push_back(tensor("stray", stray, {2}));
    gradsync::write_safetensors(path, tensors, {{"format", "pt"}});
}

}  // namespace

TEST_CASE("a checkpoint holds each tensor with the shape the model states, 0-d as 0-d") {
    TempDir dir;
    gradsync::spawn(1, [&](gradsync::LocalBackend& b) {
        Shaped model(3.0f);
        gradsync::DataParallel dp(model, b);
        std::vector<float> momentum(4, 1.0f);
        gradsync::Checkpoint().add("opt.momentum", std::span(momentum)).save(dir.path / "c.safetensors", dp);
    });
    const gradsync::SafetensorsFile file(dir.path / "c.safetensors");
    CHECK(shape_of(file, "layer.weight") == std::vector<std::uint64_t>{2, 3});
    CHECK(shape_of(file, "layer.bias") == std::vector<std::uint64_t>{3});
    CHECK(shape_of(file, "scale").empty());  // one element, no shape stated: a 0-d tensor
    CHECK(shape_of(file, "bn.running_mean") == std::vector<std::uint64_t>{3});
    CHECK(shape_of(file, "bn.num_batches_tracked").empty());
    CHECK(shape_of(file, "opt.momentum") == std::vector<std::uint64_t>{4});  // an addition: 1-D
}

TEST_CASE("a checkpoint of the previous version, every tensor 1-D, still loads") {
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        Shaped model(0.0f);
        const Shaped saved(3.0f);
        gradsync::DataParallel dp(model, b);
        std::vector<float> momentum(4);
        gradsync::Checkpoint().add("opt.momentum", std::span(momentum)).load(one_dimensional, dp);
        CHECK(model.weight == saved.weight);
        CHECK(model.bias == saved.bias);
        CHECK(model.scale == saved.scale);
        CHECK(model.running_mean == saved.running_mean);
        CHECK(model.batches == saved.batches);
        CHECK(momentum == std::vector<float>{1.5f, -2.0f, 0.25f, 8.0f});
        CHECK(dp.steps() == 5);
    });
}

TEST_CASE("a saved shape that contradicts the model's is refused, naming both, nothing loaded") {
    TempDir dir;
    write_state_dict(dir.path / "transposed.safetensors", Shaped(3.0f), {3, 2});
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        Shaped model(0.0f);
        gradsync::DataParallel dp(model, b);
        CHECK_THROWS_WITH_AS(gradsync::Checkpoint().load_weights(dir.path / "transposed.safetensors", dp),
                             doctest::Contains("tensor 'layer.weight' has shape [3, 2] there and [2, 3] here"),
                             gradsync::CheckpointError);
        CHECK(model.weight == Shaped(0.0f).weight);
    });
}

TEST_CASE("load_weights: a state dict without gradsync's metadata, on every rank, the rest untouched") {
    TempDir dir;
    const Shaped python(4.0f);
    write_state_dict(dir.path / "state_dict.safetensors", python);
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        Shaped model(static_cast<float>(b.rank()));
        gradsync::DataParallel dp(model, b);
        dp.restore_steps(9);
        gradsync::Checkpoint().load_weights(dir.path / "state_dict.safetensors", dp);
        CHECK(model.weight == python.weight);
        CHECK(model.bias == python.bias);
        CHECK(model.scale == python.scale);
        CHECK(model.running_mean == python.running_mean);
        CHECK(model.batches == python.batches);
        CHECK(dp.steps() == 9);
        // load() wants gradsync's state too, and says where to look instead.
        CHECK_THROWS_WITH_AS(gradsync::Checkpoint().load(dir.path / "state_dict.safetensors", dp),
                             doctest::Contains("lacks metadata 'gradsync.step'"), gradsync::CheckpointError);
    });
}

TEST_CASE("load_weights is strict: a tensor the model lacks, or one it has not, is refused by name") {
    TempDir dir;
    write_state_dict(dir.path / "extra.safetensors", Shaped(4.0f), {2, 3}, /*extra=*/true);
    gradsync::write_safetensors(dir.path / "short.safetensors",
                                std::vector<gradsync::TensorBytes>{tensor("layer.weight", Shaped(4.0f).weight, {2, 3})},
                                {});
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        Shaped model(0.0f);
        gradsync::DataParallel dp(model, b);
        CHECK_THROWS_WITH_AS(gradsync::Checkpoint().load_weights(dir.path / "extra.safetensors", dp),
                             doctest::Contains("it holds tensor 'stray', which nothing here loads"),
                             gradsync::CheckpointError);
        CHECK_THROWS_WITH_AS(gradsync::Checkpoint().load_weights(dir.path / "short.safetensors", dp),
                             doctest::Contains("it has no tensor 'layer.bias'"), gradsync::CheckpointError);
        CHECK(model.weight == Shaped(0.0f).weight);
    });
}
