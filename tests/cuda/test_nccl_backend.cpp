// NcclBackend and nccl_spawn on the host side: what runs without a GPU (algorithm selection,
// dtypes, argument and device errors), and that DataParallel over NcclBackend compiles in full.
// The collectives themselves are tested in the "gpu" suite of tests/cuda/test_cuda.cu.
#include <gradsync/backend/concept_checks.hpp>
#include <gradsync/backend/local.hpp>
#include <gradsync/backend/nccl.hpp>
#include <gradsync/launch/nccl_spawn.hpp>
#include <gradsync/data_parallel.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>  // for setenv, unsetenv, getenv
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

std::string env_or_none(const char* name) {
    const char* v = std::getenv(name);
    return v ? v : "<unset>";
}

// A model whose gradients lie in one buffer, as they would on the device.
struct DeviceModel {
    float* weights = nullptr;
    float* grads = nullptr;
    std::vector<gradsync::Parameter> parameters() {
        return {{"w", weights, grads, 4, gradsync::DType::float32},
                {"b", weights + 4, grads + 4, 2, gradsync::DType::float32}};
    }
};

}  // namespace

// Every member of DataParallel over NcclBackend compiles (the device path's guards included).
template class gradsync::DataParallel<DeviceModel, gradsync::NcclBackend<>>;

static_assert(gradsync::Backend<gradsync::NcclBackend<>>);
static_assert(gradsync::Abortable<gradsync::NcclBackend<gradsync::nccl::Ring>>);
static_assert(gradsync::TaggedCollectives<gradsync::NcclBackend<>>);
static_assert(gradsync::TaggedShardedCollectives<gradsync::NcclBackend<>>);
static_assert(gradsync::detail::check_sharded_collectives<gradsync::NcclBackend<gradsync::nccl::Ring>>());
static_assert(!gradsync::CheckedCollectives<gradsync::NcclBackend<>>);  // NCCL cannot compare tags
static_assert(gradsync::DeviceBackend<gradsync::NcclBackend<gradsync::nccl::Tree>>);
static_assert(!gradsync::DeviceBackend<gradsync::LocalBackend>);
static_assert(gradsync::CheckedCollectives<gradsync::LocalBackend>);
static_assert(gradsync::Waitable<gradsync::NcclHandle>);
static_assert(gradsync::DataParallel<DeviceModel, gradsync::NcclBackend<>>::gradients_untouchable);

TEST_CASE("NCCL_ALGO is set while communicators initialize with it, and restored after") {
    ::unsetenv("NCCL_ALGO");
    {
        gradsync::detail::ScopedNcclAlgo ring(gradsync::nccl::Ring::allreduce);
        CHECK(env_or_none("NCCL_ALGO") == "allreduce:ring");
        gradsync::detail::ScopedNcclAlgo same(gradsync::nccl::Ring::allreduce);  // the ranks of one spawn
        CHECK(env_or_none("NCCL_ALGO") == "allreduce:ring");
    }
    CHECK(env_or_none("NCCL_ALGO") == "<unset>");

    ::setenv("NCCL_ALGO", "Tree", 1);  // the user's own choice
    {
        gradsync::detail::ScopedNcclAlgo tree(gradsync::nccl::Tree::allreduce);
        CHECK(env_or_none("NCCL_ALGO") == "allreduce:tree");
    }
    CHECK(env_or_none("NCCL_ALGO") == "Tree");
    {
        gradsync::detail::ScopedNcclAlgo automatic(gradsync::nccl::Auto::allreduce);  // leaves it alone
        CHECK(env_or_none("NCCL_ALGO") == "Tree");
    }
    ::unsetenv("NCCL_ALGO");
}

TEST_CASE("NCCL_ALGO that already holds the value is not written (the environment races with NCCL's readers)") {
    ::setenv("NCCL_ALGO", "allreduce:ring", 1);
    const char* before = std::getenv("NCCL_ALGO");  // setenv would give the variable new storage
    {
        gradsync::detail::ScopedNcclAlgo ring(gradsync::nccl::Ring::allreduce);
        CHECK(std::getenv("NCCL_ALGO") == before);
    }
    CHECK(std::getenv("NCCL_ALGO") == before);
    CHECK(env_or_none("NCCL_ALGO") == "allreduce:ring");
    ::unsetenv("NCCL_ALGO");
}

TEST_CASE("NCCL_ALGO: a communicator of another choice waits until the others have initialized") {
    ::unsetenv("NCCL_ALGO");
    std::atomic<bool> inside{false};
    std::string seen;
    auto ring = std::make_unique<gradsync::detail::ScopedNcclAlgo>(gradsync::nccl::Ring::allreduce);
    std::thread other([&] {
        gradsync::detail::ScopedNcclAlgo tree(gradsync::nccl::Tree::allreduce);
        inside = true;
        seen = env_or_none("NCCL_ALGO");
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK_FALSE(inside.load());  // waiting for the Ring initialization
    CHECK(env_or_none("NCCL_ALGO") == "allreduce:ring");
    ring.reset();
    other.join();
    CHECK(inside.load());
    CHECK(seen == "allreduce:tree");
    CHECK(env_or_none("NCCL_ALGO") == "<unset>");
}

TEST_CASE("NCCL dtypes: the floating ones reduce, and every gradsync dtype has an NCCL type") {
    using gradsync::DType;
    CHECK(gradsync::detail::nccl_type(DType::float32) == ncclFloat32);
    CHECK(gradsync::detail::nccl_type(DType::float64) == ncclFloat64);
    CHECK(gradsync::detail::nccl_type(DType::float16) == ncclFloat16);
    CHECK(gradsync::detail::nccl_type(DType::bfloat16) == ncclBfloat16);
    CHECK(gradsync::detail::nccl_type(DType::int32) == ncclInt32);
    CHECK(gradsync::detail::nccl_type(DType::int64) == ncclInt64);
    CHECK_FALSE(gradsync::detail::nccl_type(static_cast<DType>(17)).has_value());
}

TEST_CASE("NcclBackend: a rank outside the world is refused before any device is touched") {
    ncclUniqueId id{};
    CHECK_THROWS_WITH_AS(gradsync::NcclBackend<>(2, 2, 0, id),
                         "gradsync: rank 2 of 2 (NCCL, GPU 0): the rank must be at least 0 and below the world "
                         "size, which must be at least 1",
                         gradsync::Error);
    CHECK_THROWS_AS(gradsync::NcclBackend<>(0, 0, 0, id), gradsync::Error);
}

TEST_CASE("NcclBackend without a usable device: a CudaError naming the rank and the device") {
    const auto devices = gradsync::cuda_devices();
    ncclUniqueId id{};
    if (devices.count > 0) {
        // On a GPU machine: a device that does not exist.
        std::string what;
        try {
            gradsync::NcclBackend<> backend(0, 1, devices.count, id);
        } catch (const gradsync::CudaError& e) {
            what = e.what();
        }
        CHECK(what.find("gradsync: rank 0 of 1 (NCCL, GPU " + std::to_string(devices.count) +
                        "): cannot use CUDA device ") == 0);
        return;
    }
    std::string what;
    try {
        gradsync::NcclBackend<> backend(0, 1, 0, id);
    } catch (const gradsync::CudaError& e) {
        what = e.what();
    }
    CHECK(what.find("gradsync: rank 0 of 1 (NCCL, GPU 0): cannot use CUDA device 0: gradsync: cudaSetDevice(device) "
                    "failed at ") == 0);
}

TEST_CASE("nccl_spawn: one rank per visible device, refused beyond them with the reason") {
    const auto devices = gradsync::cuda_devices();
    const auto run = [](int n) {
        std::string what;
        try {
            gradsync::nccl_spawn(n, [](gradsync::NcclBackend<>&) {});
        } catch (const gradsync::Error& e) {
            what = e.what();
        }
        return what;
    };
    CHECK(run(0).find("gradsync: nccl_spawn(0): needs from 1 to " + std::to_string(devices.count) +
                      " ranks, one per visible CUDA device") == 0);
    const auto beyond = run(devices.count + 1);
    CHECK(beyond.find("gradsync: nccl_spawn(" + std::to_string(devices.count + 1) + "): needs from 1 to " +
                      std::to_string(devices.count)) == 0);
    if (devices.count == 0) CHECK(beyond.find("(no CUDA device") != std::string::npos);
}
