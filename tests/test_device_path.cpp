// DataParallel's device path on the host: a LocalBackend that says its collectives take device
// memory (as NcclBackend and CudaLocalBackend do), and HostMemory that says it is device memory
// (as CudaMemory is). The control flow the GPU runs (stream waits instead of host waits, the
// finalize pass queued after them, measurements read once, refusals of what host memory would
// need) is tested here, under the sanitizers too; the kernels themselves in tests/cuda.
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>

#include <doctest/doctest.h>

#include "support/fake_device.hpp"
#include "support/toy_model.hpp"

#include <algorithm>  // for std::fill
#include <atomic>
#include <cmath>  // for INFINITY
#include <cstring>
#include <string>
#include <vector>

using gradsync::DataParallel;
using gradsync::LocalBackend;
using testing_support::FakeDeviceBackend;
using testing_support::FakeDeviceMemory;
using testing_support::Toy;

namespace {

static_assert(gradsync::DeviceBackend<FakeDeviceBackend>);
static_assert(gradsync::CheckedCollectives<FakeDeviceBackend>);
static_assert(DataParallel<Toy, FakeDeviceBackend>::gradients_untouchable);
static_assert(!DataParallel<Toy, FakeDeviceBackend, FakeDeviceMemory>::gradients_untouchable);

// Toy's tensors, with every gradient in one buffer in registration order, as
// ContiguousParameters lays them out.
struct ContiguousToy {
    std::vector<std::size_t> sizes;
    std::vector<float> w, g;
    explicit ContiguousToy(std::vector<std::size_t> s) : sizes(std::move(s)) {
        std::size_t total = 0;
        for (auto n : sizes) total += n;
        w.assign(total, 0.0f);
        g.assign(total, 0.0f);
    }
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        std::size_t at = 0;
        for (std::size_t k = 0; k < sizes.size(); ++k) {
            out.push_back({"t" + std::to_string(k), w.data() + at, g.data() + at, sizes[k], gradsync::DType::float32});
            at += sizes[k];
        }
        return out;
    }
    void fill_grads(int rank) {
        std::size_t at = 0;
        for (std::size_t k = 0; k < sizes.size(); ++k)
            for (std::size_t i = 0; i < sizes[k]; ++i) g[at++] = Toy::grad_value(rank, k, i);
    }
};

template <class Fn>
std::vector<std::string> device_messages_of(int world, Fn fn) {
    std::vector<std::string> out(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](LocalBackend& b) {
        FakeDeviceBackend device(b);
        try {
            fn(device);
        } catch (const gradsync::Error& e) {
            out[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    return out;
}

}  // namespace

TEST_CASE(
    "device gradients under HostMemory: contiguous ones are averaged where they lie, the stream waits for "
    "each bucket, and the backend's health is polled") {
    const std::vector<std::size_t> sizes{5, 3000, 1, 40000, 17};
    std::atomic<int> wrong{0};
    gradsync::spawn(3, [&](LocalBackend& b) {
        FakeDeviceBackend device(b);
        ContiguousToy model(sizes);
        DataParallel dp(model, device, gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{64 << 10}});
        model.fill_grads(b.rank());
        for (std::size_t i = sizes.size(); i-- > 0;) dp.grad_ready(i);
        dp.synchronize();
        CHECK(device.device_waits == static_cast<int>(dp.plan().buckets.size()));
        CHECK(device.health_checks == 2);  // before the step's work and after its measurements
        std::size_t at = 0;
        for (std::size_t k = 0; k < sizes.size(); ++k)
            for (std::size_t i = 0; i < sizes[k]; ++i)
                wrong += model.g[at++] != testing_support::expected_average<float>(3, k, i);
    });
    CHECK(wrong.load() == 0);
}

TEST_CASE("device gradients under HostMemory: what would touch them on the host is refused on every rank") {
    auto scattered = device_messages_of(2, [](FakeDeviceBackend& b) {
        Toy model({100, 200}, 0.0f);  // a vector per tensor: not adjacent
        DataParallel dp(model, b);
    });
    for (const auto& m : scattered) {
        CHECK(m == scattered[0]);
        CHECK(m.find("are not adjacent in memory, and without a device memory policy they cannot be packed") !=
              std::string::npos);
    }
    auto unused = device_messages_of(2, [](FakeDeviceBackend& b) {
        ContiguousToy model({10, 20});
        DataParallel dp(model, b, gradsync::Options{.find_unused_parameters = true});
    });
    for (const auto& m : unused)
        CHECK(m.find("find_unused_parameters zeroes unused gradients, which device gradients need a device memory "
                     "policy for") != std::string::npos);
    auto stepped = device_messages_of(2, [](FakeDeviceBackend& b) {
        ContiguousToy model({10, 20});
        DataParallel dp(model, b);
        model.fill_grads(b.rank());
        dp.step([] {});
    });
    for (std::size_t r = 0; r < stepped.size(); ++r)  // each rank refuses, naming itself
        CHECK(stepped[r].find("gradsync: rank " + std::to_string(r) +
                              ": step(), loss scaling and clipping need the finalize pass over the gradients, which "
                              "device gradients get from a device memory policy") == 0);
}

TEST_CASE("device memory policy: packed, unscaled, measured and stepped as on the host, bit for bit") {
    const std::vector<std::size_t> sizes{5, 3000, 1, 40000, 17};
    std::vector<std::vector<float>> host(2), device(2);
    std::vector<double> host_norm(2), device_norm(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        const auto r = static_cast<std::size_t>(b.rank());
        {
            Toy model(sizes, 0.0f);
            DataParallel dp(model, b, gradsync::PackedBuckets{}, gradsync::StaticLossScale{.value = 8.0f});
            model.fill_grads(b.rank());
            host_norm[r] = dp.step([] {}).grad_norm;
            for (const auto& t : model.tensors) host[r].insert(host[r].end(), t.g.begin(), t.g.end());
        }
        FakeDeviceBackend fake(b);
        Toy model(sizes, 0.0f);
        DataParallel dp(model, fake, FakeDeviceMemory{}, gradsync::StaticLossScale{.value = 8.0f});
        model.fill_grads(b.rank());
        for (std::size_t i = sizes.size(); i-- > 0;) dp.grad_ready(i);
        const auto report = dp.step([] {});
        CHECK(report.applied);
        CHECK(fake.device_waits == static_cast<int>(dp.plan().buckets.size()));
        device_norm[r] = report.grad_norm;
        for (const auto& t : model.tensors) device[r].insert(device[r].end(), t.g.begin(), t.g.end());
    });
    for (std::size_t r = 0; r < 2; ++r) {
        CHECK(device[r] == host[r]);
        CHECK(std::memcmp(&device_norm[r], &host_norm[r], sizeof(double)) == 0);
    }
}

TEST_CASE(
    "device memory policy: a float16 sum that overflows is reduced again in float32, and an overflow in a "
    "gradient is named, and a failure the backend found is thrown at synchronize") {
    gradsync::spawn(2, [&](LocalBackend& b) {
        FakeDeviceBackend fake(b);
        Toy model({1000, 10}, 0.0f);
        DataParallel dp(model, fake, FakeDeviceMemory{}, gradsync::Fp16Compression{});
        std::fill(model.tensors[0].g.begin(), model.tensors[0].g.end(), 1e5f);  // each rank sends 5e4: fine
        std::fill(model.tensors[1].g.begin(), model.tensors[1].g.end(), 2.0f);
        auto report = dp.step([] {});
        CHECK(report.applied);
        CHECK(model.tensors[0].g[7] == 1e5f);  // the float16 sum overflowed; reduced again in float32
        CHECK(model.tensors[1].g[3] == 2.0f);

        std::fill(model.tensors[0].g.begin(), model.tensors[0].g.end(), 1.0f);
        model.tensors[1].g[4] = b.rank() == 1 ? INFINITY : 1.0f;
        report = dp.step([] { FAIL("the optimizer ran on a non-finite gradient"); });
        CHECK_FALSE(report.applied);
        CHECK(report.overflowed == std::vector<std::string>{"t1"});

        fake.barrier();  // both ranks are done with the step before either reports a failure
        fake.failure = "gradsync: rank " + std::to_string(b.rank()) + ": the communicator failed";
        CHECK_THROWS_WITH_AS(dp.synchronize(), doctest::Contains("the communicator failed"), gradsync::CollectiveError);
    });
}

// A device backend that cannot compare tags (as NcclBackend), counting the float64 allreduces
// that compare the ranks' collective histories.
struct UncheckedDeviceBackend : FakeDeviceBackend {
    static constexpr bool checks_tags = false;
    using FakeDeviceBackend::FakeDeviceBackend;
    void allreduce(gradsync::Buffer buf, gradsync::ReduceOp op, gradsync::CollectiveTag tag = {}) {
        histories += buf.dtype == gradsync::DType::float64;
        FakeDeviceBackend::allreduce(buf, op, tag);
    }
    int histories = 0;
};
static_assert(!gradsync::CheckedCollectives<UncheckedDeviceBackend>);

TEST_CASE("history check on a device backend: off unless asked for, since it would make the host wait") {
    std::vector<int> by_default(2), asked(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        const auto r = static_cast<std::size_t>(b.rank());
        {
            UncheckedDeviceBackend device(b);
            ContiguousToy model({10, 20});
            DataParallel dp(model, device);
            device.histories = 0;  // construction agreed on the layout
            dp.synchronize();
            dp.synchronize();
            by_default[r] = device.histories;
        }
        UncheckedDeviceBackend device(b);
        ContiguousToy model({10, 20});
        DataParallel dp(model, device, gradsync::Options{.check_histories = true});
        device.histories = 0;
        dp.synchronize();
        dp.synchronize();
        asked[r] = device.histories;
    });
    CHECK(by_default == std::vector<int>{0, 0});
    CHECK(asked == std::vector<int>{2, 2});
}

TEST_CASE("a device memory policy on another stream than the backend's compute stream is refused on every rank") {
    static int streams[2];
    auto mismatched = device_messages_of(2, [](FakeDeviceBackend& b) {
        b.stream = &streams[0];
        ContiguousToy model({10, 20});
        DataParallel dp(model, b, FakeDeviceMemory(b.rank() == 1 ? &streams[1] : &streams[0]));
    });
    for (const auto& m : mismatched) {
        CHECK(m == mismatched[0]);
        CHECK(m.find("gradsync: invalid configuration on rank 1: the memory policy's stream (0x") == 0);
        CHECK(m.find("is not the backend's compute stream (0x") != std::string::npos);
        CHECK(m.find("CudaMemory{stream} and NcclOptions::compute_stream") != std::string::npos);
    }
    auto same = device_messages_of(2, [](FakeDeviceBackend& b) {
        b.stream = &streams[1];
        ContiguousToy model({10, 20});
        DataParallel dp(model, b, FakeDeviceMemory(&streams[1]));
    });
    CHECK(same == std::vector<std::string>(2));
}

TEST_CASE("step_on_device: the verdict stays where the memory policy keeps it, and the optimizer reads it") {
    gradsync::spawn(2, [&](LocalBackend& b) {
        FakeDeviceBackend fake(b);
        Toy model({300, 20}, 0.0f);
        DataParallel dp(model, fake, FakeDeviceMemory{}, gradsync::StaticLossScale{.value = 4.0f});
        model.fill_grads(b.rank());
        int applied = 0;
        dp.step_on_device([&](const gradsync::StepVerdict* verdict) { applied += verdict->finite; });
        CHECK(applied == 1);
        CHECK(dp.steps() == 1);
        CHECK(model.tensors[1].g[3] == testing_support::expected_average<float>(2, 1, 3) / 4.0f);

        model.fill_grads(b.rank());
        model.tensors[0].g[9] = b.rank() == 0 ? NAN : 1.0f;
        double norm_squared = 0;
        dp.step_on_device([&](const gradsync::StepVerdict* verdict) {
            applied += verdict->finite;
            norm_squared = verdict->sum_squares;
        });
        CHECK(applied == 1);  // every rank sees the same verdict: not finite
        CHECK(std::isnan(norm_squared));
        CHECK(dp.steps() == 2);
    });
    // Clipping needs the norm on the host.
    gradsync::spawn(1, [&](LocalBackend& b) {
        FakeDeviceBackend fake(b);
        Toy model({10}, 0.0f);
        DataParallel dp(model, fake, FakeDeviceMemory{}, gradsync::Options{.clip_norm = 1.0});
        CHECK_THROWS_WITH_AS(dp.step_on_device([](const gradsync::StepVerdict*) {}),
                             doctest::Contains("step_on_device() cannot clip"), gradsync::Error);
    });
}
