// NcclBackend's failure paths, run on the stand-ins for the CUDA runtime and NCCL (tests/standin):
// a rank that never issues its collective, one that throws, an asynchronous NCCL error, a stream
// too slow for the deadline, a rank that never joins. Every rank ends by its deadline with an
// error that names the operation, and no destructor waits out the timeout; a peer in the same
// process is named with where it stands. Also the device a waiting thread leaves current.
#include <doctest/doctest.h>

#include "standin/standin.hpp"

#include <gradsync/backend/nccl.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/nccl_spawn.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

using Clock = std::chrono::steady_clock;

// What nccl_spawn(n, fn, options) threw ("" for nothing), and how long it took.
template <class Fn>
std::pair<std::string, Clock::duration> spawn_failure(int n, const Fn& fn, gradsync::NcclOptions options) {
    const auto began = Clock::now();
    std::string what;
    try {
        gradsync::nccl_spawn(n, fn, options);
    } catch (const std::exception& e) {
        what = e.what();
    }
    return {what, Clock::now() - began};
}

struct DeviceFloats {
    explicit DeviceFloats(std::size_t n) : count(n) { GRADSYNC_CUDA_CHECK(cudaMalloc(&data, n * sizeof(float))); }
    DeviceFloats(const DeviceFloats&) = delete;
    DeviceFloats& operator=(const DeviceFloats&) = delete;
    ~DeviceFloats() { cudaFree(data); }
    [[nodiscard]] gradsync::Buffer buffer() const { return {data, count, gradsync::DType::float32}; }
    float* data = nullptr;
    std::size_t count = 0;
};

}  // namespace

TEST_CASE("NcclBackend on the stand-ins: a rank that never issues its collective fails its peer at the deadline") {
    const auto [what, took] = spawn_failure(
        2,
        [](gradsync::NcclBackend<>& backend) {
            if (backend.rank() == 1) return;  // never issues it
            DeviceFloats data(8);
            backend.allreduce(data.buffer());
        },
        gradsync::NcclOptions{.timeout = 300ms});
    CHECK(what.find("gradsync: rank 0 of 2 (NCCL, GPU 0): allreduce") == 0);
    CHECK(what.find("did not complete by its deadline; the communicator was aborted") != std::string::npos);
    CHECK(took < 30s);
}

TEST_CASE(
    "NcclBackend on the stand-ins: a collective past its deadline names where its peers in this process stand: "
    "the rank stuck in backward, how many collectives it entered, its step and the gradients it waits for") {
    std::atomic<bool> rank0_failed{false};
    const auto [what, took] = spawn_failure(
        2,
        [&](gradsync::NcclBackend<>& backend) {
            DeviceFloats weights(12), grads(12);
            struct Model {
                float *w, *g;
                std::vector<gradsync::Parameter> parameters() {
                    return {{"p0", w, g, 4, gradsync::DType::float32},
                            {"p1", w + 4, g + 4, 4, gradsync::DType::float32},
                            {"p2", w + 8, g + 8, 4, gradsync::DType::float32}};
                }
            } model{weights.data, grads.data};
            gradsync::DataParallel dp(model, backend);
            if (backend.rank() == 1) {
                dp.grad_ready("p2");  // backward reached p2, and stalls there until rank 0 has failed
                for (int i = 0; i < 2000 && !rank0_failed; ++i) std::this_thread::sleep_for(10ms);
                return;
            }
            try {
                dp.synchronize();  // queued; the host does not wait, the watchdog finds it late
                for (int i = 0; i < 2000; ++i) {
                    backend.throw_if_failed();
                    std::this_thread::sleep_for(10ms);
                }
            } catch (...) {
                rank0_failed = true;
                throw;
            }
        },
        gradsync::NcclOptions{.timeout = 300ms});
    CAPTURE(what);
    CHECK(what.find("gradsync: rank 0 of 2 (NCCL, GPU 0): allreduce") == 0);
    CHECK(what.find("did not complete by its deadline") != std::string::npos);
    const auto peers = what.find(" Where its peers in this process stand: rank 1 has entered ");
    REQUIRE(peers != std::string::npos);
    CHECK(what.find("collectives (this rank ", peers) != std::string::npos);
    CHECK(what.find("in the backward of step 1, 0 of 1 buckets launched; bucket 0 waits for grad_ready of 'p1', "
                    "'p0' (2 of 3 parameters)",
                    peers) != std::string::npos);
    CHECK(took < 30s);
}

TEST_CASE(
    "NcclBackend on the stand-ins: a backend destroyed with a collective pending aborts at once instead of "
    "flushing for the whole timeout") {
    const auto [what, took] = spawn_failure(
        2,
        [](gradsync::NcclBackend<>& backend) {
            if (backend.rank() == 1) return;  // never issues it
            // Not freed: cudaFree waits for the device, where the abandoned collective still spins
            // until the backend's destructor aborts it (on a GPU as here).
            float* data = nullptr;
            GRADSYNC_CUDA_CHECK(cudaMalloc(&data, 8 * sizeof(float)));
            (void)backend.allreduce_async(gradsync::Buffer{data, 8, gradsync::DType::float32});
        },
        gradsync::NcclOptions{.timeout = 120s});
    CHECK(what.empty());
    CHECK(took < 30s);  // not the 120 s timeout
}

TEST_CASE(
    "NcclBackend on the stand-ins: a rank that throws ends its peers' waits at once and its exception is "
    "the one rethrown") {
    const auto [what, took] = spawn_failure(
        3,
        [](gradsync::NcclBackend<>& backend) {
            if (backend.rank() == 2) throw std::runtime_error("rank 2 ran out of data");
            DeviceFloats data(8);
            backend.allreduce(data.buffer());
        },
        gradsync::NcclOptions{.timeout = 120s});
    CHECK(what == "rank 2 ran out of data");
    CHECK(took < 30s);
}

TEST_CASE("NcclBackend on the stand-ins: an asynchronous NCCL error fails the communicator with NCCL's words") {
    const auto [what, took] = spawn_failure(
        2,
        [](gradsync::NcclBackend<>& backend) {
            DeviceFloats data(8);
            backend.allreduce(data.buffer());  // both healthy first
            if (backend.rank() == 0)
                standin::nccl_inject_error(backend.comm(), ncclRemoteError,
                                           "NET/Socket : peer 1 closed the connection");
            backend.allreduce(data.buffer());
        },
        gradsync::NcclOptions{.timeout = 120s});
    CHECK(what.find("gradsync: rank 0 of 2 (NCCL, GPU 0): ") == 0);
    CHECK(what.find("remote process exited or there was a network error (NET/Socket : peer 1 closed the "
                    "connection)") != std::string::npos);
    CHECK(took < 30s);
}

TEST_CASE("NcclBackend on the stand-ins: a stream too slow for the deadline fails every rank by it") {
    const auto [what, took] = spawn_failure(
        2,
        [](gradsync::NcclBackend<>& backend) {
            DeviceFloats data(8);
            if (backend.rank() == 1) standin::slow_stream(backend.stream(), 1s);
            backend.allreduce(data.buffer());
        },
        gradsync::NcclOptions{.timeout = 200ms});
    CHECK(what.find("did not complete by its deadline") != std::string::npos);
    CHECK(took < 30s);
}

TEST_CASE("NcclBackend on the stand-ins: a rank that never joins ends the join at the deadline, naming it") {
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    ncclUniqueId id{};
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    std::string what;
    try {
        gradsync::NcclBackend<> alone(0, 2, 0, id, gradsync::NcclOptions{.timeout = 200ms});
    } catch (const gradsync::TimeoutError& e) {
        what = e.what();
    }
    CHECK(what.find("gradsync: rank 0 of 2 (NCCL, GPU 0): the ranks did not all join the NCCL communicator within "
                    "200 ms") == 0);
}

TEST_CASE(
    "NcclBackend on the stand-ins: a thread that never chose a device waits for a collective without "
    "making a context on device 0") {
    (void)standin::take_misuses();
    std::thread([] {
        ncclUniqueId id{};
        REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
        gradsync::NcclBackend<> backend(0, 1, 2, id, gradsync::NcclOptions{.watchdog_period = 0ms});
        DeviceFloats data(8);
        standin::slow_stream(backend.stream(), 50ms);  // pending while the waiter looks
        auto handle = backend.allreduce_async(data.buffer());
        const int contexts = standin::contexts_made(0);
        std::thread([&] { handle.wait(); }).join();
        CHECK(standin::contexts_made(0) == contexts);
    }).join();
    CHECK(standin::take_misuses().empty());
}

TEST_CASE("NcclBackend on the stand-ins: host memory for reduce_scatter and all_gather is refused before NCCL") {
    std::string what;
    gradsync::nccl_spawn(1, [&](gradsync::NcclBackend<>& backend) {
        std::vector<float> host(8);
        try {
            backend.reduce_scatter(gradsync::Buffer{host.data(), host.size(), gradsync::DType::float32});
        } catch (const gradsync::CollectiveError& e) {
            what = e.what();
        }
    });
    CHECK(what ==
          "gradsync: rank 0 of 1 (NCCL, GPU 0): reduce_scatter takes device (or managed) memory; this buffer "
          "lies in host memory");
}

TEST_CASE(
    "NcclBackend on the stand-ins: a backend destroyed while a stream waits for its collective flushes it: "
    "the late peer's part arrives and the sum lands") {
    std::vector<float*> data(2, nullptr);
    const auto [what, took] = spawn_failure(
        2,
        [&](gradsync::NcclBackend<>& backend) {
            const auto r = std::size_t(backend.rank());
            // Not freed here: cudaFree would wait for the device, where the collective may still run.
            GRADSYNC_CUDA_CHECK(cudaMalloc(&data[r], sizeof(float)));
            const float mine = float(r + 1);
            GRADSYNC_CUDA_CHECK(cudaMemcpy(data[r], &mine, sizeof mine, cudaMemcpyHostToDevice));
            GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
            if (r == 1) std::this_thread::sleep_for(200ms);  // the peer comes late
            auto handle = backend.allreduce_async(gradsync::Buffer{data[r], 1, gradsync::DType::float32});
            backend.wait_on_device(handle);  // the trainer's stream waits; the host goes on, and ends
        },
        gradsync::NcclOptions{.timeout = 120s});
    CHECK(what.empty());
    CHECK(took < 30s);
    for (int r = 0; r < 2; ++r) {
        REQUIRE(cudaSetDevice(r) == cudaSuccess);
        float sum = 0;
        REQUIRE(cudaMemcpy(&sum, data[std::size_t(r)], sizeof sum, cudaMemcpyDeviceToHost) == cudaSuccess);
        CHECK(sum == 3.0f);
        CHECK(cudaFree(data[std::size_t(r)]) == cudaSuccess);
    }
}
