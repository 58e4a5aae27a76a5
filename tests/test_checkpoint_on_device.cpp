// Checkpoints of fronts whose tensors lie in device memory: every tensor is read and written
// through the memory policy's copies to and from the host, never where it lies. The stand-in
// device memory here keeps each byte XORed with a key, which only its own copies undo: a
// checkpoint that read the tensors where they lie would write the encoded bytes to the file, and
// one that wrote them there would load the file's plain bytes.
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/checkpoint/safetensors_file.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "support/fake_device.hpp"
#include "support/temp_dir.hpp"
#include "support/toy_model.hpp"

#include <atomic>
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

using gradsync::LocalBackend;
using testing_support::FakeDeviceBackend;
using testing_support::FakeDeviceMemory;
using testing_support::Toy;

namespace {

constexpr std::byte key{0x5a};

// Device memory as the host cannot read it directly: each byte XORed with `key`.
struct EncodedDeviceMemory : FakeDeviceMemory {
    void to_host(std::span<std::byte> host, const std::byte* from) const {
        for (std::size_t i = 0; i < host.size(); ++i) host[i] = from[i] ^ key;
        copies_out->fetch_add(1);
    }
    void from_host(std::byte* to, std::span<const std::byte> host) const {
        for (std::size_t i = 0; i < host.size(); ++i) to[i] = host[i] ^ key;
        copies_in->fetch_add(1);
    }
    std::shared_ptr<std::atomic<int>> copies_out = std::make_shared<std::atomic<int>>(0);
    std::shared_ptr<std::atomic<int>> copies_in = std::make_shared<std::atomic<int>>(0);
};

// `plain` as the device memory holds it.
void store(std::span<float> device, const std::vector<float>& plain) {
    REQUIRE(device.size() == plain.size());
    auto* out = reinterpret_cast<std::byte*>(device.data());
    const auto* in = reinterpret_cast<const std::byte*>(plain.data());
    for (std::size_t i = 0; i < plain.size() * sizeof(float); ++i) out[i] = in[i] ^ key;
}
std::vector<float> read(std::span<const float> device) {
    std::vector<float> plain(device.size());
    auto* out = reinterpret_cast<std::byte*>(plain.data());
    const auto* in = reinterpret_cast<const std::byte*>(device.data());
    for (std::size_t i = 0; i < plain.size() * sizeof(float); ++i) out[i] = in[i] ^ key;
    return plain;
}
std::vector<float> values(std::size_t n, float first) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = first + 0.25f * static_cast<float>(i);
    return v;
}
std::vector<float> in_file(const gradsync::SafetensorsFile& file, const std::string& name) {
    const auto* t = file.find(name);
    REQUIRE(t != nullptr);
    std::vector<float> out(t->bytes.size() / sizeof(float));
    std::memcpy(out.data(), t->bytes.data(), t->bytes.size());
    return out;
}

const std::vector<std::size_t> sizes{5, 300, 17};

Toy encoded_toy() {
    Toy model(sizes, 0.0f);
    for (std::size_t k = 0; k < sizes.size(); ++k)
        store(model.tensors[k].w, values(sizes[k], 100.0f * static_cast<float>(k + 1)));
    return model;
}

// Every parameter overwritten with what no load leaves.
void scribble(Toy& model) {
    for (auto& t : model.tensors) store(t.w, std::vector<float>(t.w.size(), -7.0f));
}

}  // namespace

TEST_CASE(
    "checkpoint of a DataParallel on device memory: parameters, additions and each rank's own state go to the "
    "file and come back through the memory policy's copies") {
    TempDir dir;
    const auto path = dir.path / "device.safetensors";
    std::atomic<int> wrong{0};
    gradsync::spawn(2, [&](LocalBackend& b) {
        FakeDeviceBackend device(b);
        Toy model = encoded_toy();
        EncodedDeviceMemory memory;
        gradsync::DataParallel dp(model, device, memory);
        std::vector<float> moment(40), own(9);
        store(moment, values(40, -3.0f));
        store(own, values(9, 50.0f * static_cast<float>(b.rank() + 1)));
        gradsync::Checkpoint checkpoint;
        checkpoint.add("adam.m", std::span(moment)).add_local("feedback", std::span(own));
        checkpoint.save(path, dp);
        if (b.rank() == 0) {
            const gradsync::SafetensorsFile file(path);
            for (std::size_t k = 0; k < sizes.size(); ++k)
                if (in_file(file, "t" + std::to_string(k)) != values(sizes[k], 100.0f * static_cast<float>(k + 1)))
                    ++wrong;
            if (in_file(file, "adam.m") != values(40, -3.0f)) ++wrong;
        }
        if (*memory.copies_out == 0) ++wrong;  // the front's copy of the policy shares the count

        scribble(model);
        store(moment, std::vector<float>(40, 0.0f));
        store(own, std::vector<float>(9, 0.0f));
        checkpoint.load(path, dp);
        for (std::size_t k = 0; k < sizes.size(); ++k)
            if (read(model.tensors[k].w) != values(sizes[k], 100.0f * static_cast<float>(k + 1))) ++wrong;
        if (read(moment) != values(40, -3.0f)) ++wrong;
        if (read(own) != values(9, 50.0f * static_cast<float>(b.rank() + 1))) ++wrong;
    });
    CHECK(wrong == 0);
}

TEST_CASE(
    "checkpoint of a ShardedDataParallel on device memory: each rank's optimizer state goes to its shard file and "
    "comes back through the memory policy's copies") {
    TempDir dir;
    const auto path = dir.path / "sharded.safetensors";
    std::atomic<int> wrong{0};
    gradsync::spawn(2, [&](LocalBackend& b) {
        FakeDeviceBackend device(b);
        Toy model = encoded_toy();
        gradsync::ShardedDataParallel dp(model, device, EncodedDeviceMemory{});
        const auto state_values = values(dp.state_elements(), 1000.0f * static_cast<float>(b.rank() + 1));
        std::vector<float> state(dp.state_elements());
        store(state, state_values);
        gradsync::Checkpoint checkpoint;
        checkpoint.add_shard("adam.m", std::span(state));
        checkpoint.save(path, dp);
        if (b.rank() == 0) {
            const gradsync::SafetensorsFile file(path);
            if (in_file(file, "t1") != values(sizes[1], 200.0f)) ++wrong;
        }

        scribble(model);
        store(state, std::vector<float>(state.size(), 0.0f));
        checkpoint.load(path, dp);
        for (std::size_t k = 0; k < sizes.size(); ++k)
            if (read(model.tensors[k].w) != values(sizes[k], 100.0f * static_cast<float>(k + 1))) ++wrong;
        if (read(state) != state_values) ++wrong;
    });
    CHECK(wrong == 0);
}
