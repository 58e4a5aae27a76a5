// The stand-ins for the CUDA runtime and NCCL (tests/standin) do what the tests that run on them
// rely on: a stream runs its work in order and late, an event tells when, a stream waits for
// another's event, NCCL's ranks meet at each collective and reduce in rank order, and each misuse
// a GPU would punish late or never is reported at once.
#include <doctest/doctest.h>

#include "standin/standin.hpp"

#include <gradsync/half.hpp>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

// The misuses reported while `f` ran.
template <class F>
std::vector<std::string> misuses_of(F&& f) {
    (void)standin::take_misuses();
    f();
    return standin::take_misuses();
}

bool mentions(const std::vector<std::string>& misuses, const std::string& words) {
    for (const auto& m : misuses)
        if (m.find(words) != std::string::npos) return true;
    return false;
}

}  // namespace

TEST_CASE("stand-in CUDA: a slow stream runs its copies in order and late, and events and waits order two streams") {
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    (void)standin::take_misuses();
    cudaStream_t first = nullptr, second = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&first, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking) == cudaSuccess);
    float* device = nullptr;
    REQUIRE(cudaMalloc(&device, 4 * sizeof(float)) == cudaSuccess);
    float* pinned = nullptr;
    REQUIRE(cudaMallocHost(&pinned, 4 * sizeof(float)) == cudaSuccess);
    for (int i = 0; i < 4; ++i) pinned[i] = float(i + 1);

    standin::slow_stream(first, std::chrono::milliseconds(30));
    cudaEvent_t copied = nullptr;
    REQUIRE(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming) == cudaSuccess);
    CHECK(cudaMemcpyAsync(device, pinned, 4 * sizeof(float), cudaMemcpyHostToDevice, first) == cudaSuccess);
    CHECK(cudaEventRecord(copied, first) == cudaSuccess);
    CHECK(cudaEventQuery(copied) == cudaErrorNotReady);  // the host queued it without waiting
    CHECK(cudaStreamQuery(first) == cudaErrorNotReady);

    // The second stream copies back only after the first one's copy.
    std::vector<float> back(4, 0.0f);
    float* out = nullptr;
    REQUIRE(cudaMallocHost(&out, 4 * sizeof(float)) == cudaSuccess);
    CHECK(cudaStreamWaitEvent(second, copied, 0) == cudaSuccess);
    CHECK(cudaMemcpyAsync(out, device, 4 * sizeof(float), cudaMemcpyDeviceToHost, second) == cudaSuccess);
    const auto waits = standin::host_waits();
    CHECK(cudaStreamSynchronize(second) == cudaSuccess);
    CHECK(standin::host_waits() == waits + 1);
    CHECK(cudaEventQuery(copied) == cudaSuccess);
    std::memcpy(back.data(), out, 4 * sizeof(float));
    CHECK(back == std::vector<float>{1, 2, 3, 4});

    cudaPointerAttributes attributes{};
    CHECK(cudaPointerGetAttributes(&attributes, device + 2) == cudaSuccess);
    CHECK(attributes.type == cudaMemoryTypeDevice);
    CHECK(cudaPointerGetAttributes(&attributes, back.data()) == cudaSuccess);
    CHECK(attributes.type == cudaMemoryTypeUnregistered);

    CHECK(cudaFree(device) == cudaSuccess);
    CHECK(cudaFreeHost(pinned) == cudaSuccess);
    CHECK(cudaFreeHost(out) == cudaSuccess);
    CHECK(cudaEventDestroy(copied) == cudaSuccess);
    CHECK(cudaStreamDestroy(first) == cudaSuccess);
    CHECK(cudaStreamDestroy(second) == cudaSuccess);
    CHECK(standin::take_misuses().empty());
}

TEST_CASE(
    "stand-in CUDA: misuses are reported: a wait for an event never recorded, a thread that never chose "
    "its device, a copy whose kind does not match its memory") {
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    cudaStream_t stream = nullptr;
    REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
    cudaEvent_t never = nullptr;
    REQUIRE(cudaEventCreate(&never) == cudaSuccess);
    CHECK(mentions(misuses_of([&] { CHECK(cudaStreamWaitEvent(stream, never, 0) == cudaSuccess); }),
                   "cudaStreamWaitEvent on an event never recorded"));

    const int contexts = standin::contexts_made(0);
    std::vector<std::string> seen;
    std::thread([&] {
        seen = misuses_of([] {
            void* p = nullptr;
            CHECK(cudaMalloc(&p, 16) == cudaSuccess);
            CHECK(cudaSetDevice(0) == cudaSuccess);
            CHECK(cudaFree(p) == cudaSuccess);
        });
    }).join();
    CHECK(mentions(seen, "cudaMalloc from a thread that never called cudaSetDevice"));
    CHECK(standin::contexts_made(0) == contexts + 1);  // the context it made on device 0

    float host = 1.0f;
    float* device = nullptr;
    REQUIRE(cudaMalloc(&device, sizeof(float)) == cudaSuccess);
    CHECK(mentions(misuses_of([&] {
                       CHECK(cudaMemcpy(&host, device, sizeof host, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
                   }),
                   "does not match the copy's kind"));
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
    CHECK(cudaGetLastError() == cudaSuccess);
    CHECK(cudaFree(device) == cudaSuccess);
    CHECK(cudaEventDestroy(never) == cudaSuccess);
    CHECK(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE(
    "stand-in CUDA: a pageable copy lands on the device after cudaMemcpy returns, and a blocking stream waits "
    "for it, a non-blocking one does not") {
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    cudaStream_t blocking = nullptr;
    REQUIRE(cudaStreamCreate(&blocking) == cudaSuccess);
    float* device = nullptr;
    REQUIRE(cudaMalloc(&device, sizeof(float)) == cudaSuccess);
    float* pinned = nullptr;
    REQUIRE(cudaMallocHost(&pinned, sizeof(float)) == cudaSuccess);
    // The default stream is slowed: what it was given lands late.
    standin::slow_stream(nullptr, std::chrono::milliseconds(20));
    const float value = 7.0f;
    CHECK(cudaMemcpy(device, &value, sizeof value, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemcpyAsync(pinned, device, sizeof value, cudaMemcpyDeviceToHost, blocking) == cudaSuccess);
    CHECK(cudaStreamSynchronize(blocking) == cudaSuccess);
    CHECK(*pinned == 7.0f);  // the blocking stream waited for the default stream's copy
    standin::slow_stream(nullptr, std::chrono::microseconds(0));
    CHECK(cudaFree(device) == cudaSuccess);
    CHECK(cudaFreeHost(pinned) == cudaSuccess);
    CHECK(cudaStreamDestroy(blocking) == cudaSuccess);
}

TEST_CASE("stand-in NCCL: ranks on threads join, reduce in rank order, and host memory is refused as a misuse") {
    constexpr int n = 3;
    ncclUniqueId id{};
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    std::vector<std::vector<float>> results(n);
    (void)standin::take_misuses();
    std::vector<std::thread> ranks;
    for (int r = 0; r < n; ++r) {
        ranks.emplace_back([&, r] {
            REQUIRE(cudaSetDevice(r) == cudaSuccess);
            ncclComm_t comm = nullptr;
            ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
            config.blocking = 0;
            ncclResult_t joined = ncclCommInitRankConfig(&comm, n, id, r, &config);
            CHECK(joined == ncclInProgress);
            while (joined == ncclInProgress) REQUIRE(ncclCommGetAsyncError(comm, &joined) == ncclSuccess);
            REQUIRE(joined == ncclSuccess);
            const std::vector<float> mine = {0.1f * float(r + 1), 1e8f * float(r == 0 ? 1 : -1), float(r)};
            float* data = nullptr;
            REQUIRE(cudaMalloc(&data, mine.size() * sizeof(float)) == cudaSuccess);
            REQUIRE(cudaMemcpy(data, mine.data(), mine.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
            ncclResult_t queued = ncclAllReduce(data, data, mine.size(), ncclFloat32, ncclSum, comm, nullptr);
            while (queued == ncclInProgress) REQUIRE(ncclCommGetAsyncError(comm, &queued) == ncclSuccess);
            CHECK(queued == ncclSuccess);
            results[std::size_t(r)].resize(mine.size());
            REQUIRE(cudaMemcpy(results[std::size_t(r)].data(), data, mine.size() * sizeof(float),
                               cudaMemcpyDeviceToHost) == cudaSuccess);
            std::vector<float> host(3);
            CHECK(ncclAllReduce(host.data(), host.data(), 3, ncclFloat32, ncclSum, comm, nullptr) ==
                  ncclInvalidArgument);
            CHECK(std::string(ncclGetLastError(comm)).find("lies in host memory") != std::string::npos);
            CHECK(ncclCommFinalize(comm) == ncclInProgress);
            ncclResult_t flushed = ncclInProgress;
            while (flushed == ncclInProgress) REQUIRE(ncclCommGetAsyncError(comm, &flushed) == ncclSuccess);
            CHECK(flushed == ncclSuccess);
            CHECK(ncclCommDestroy(comm) == ncclSuccess);
            CHECK(cudaFree(data) == cudaSuccess);
        });
    }
    for (auto& t : ranks) t.join();
    // Rank order, in float: (0.1 + 0.2) + 0.3, and 1e8 - 1e8 - 1e8.
    const std::vector<float> expected = {(0.1f + 0.2f) + 0.3f, (1e8f + -1e8f) + -1e8f, 3.0f};
    for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        CHECK(std::memcmp(results[std::size_t(r)].data(), expected.data(), expected.size() * sizeof(float)) == 0);
    }
    const auto misuses = standin::take_misuses();
    CHECK(misuses.size() == std::size_t(n));  // one host buffer handed to ncclAllReduce by each rank
    CHECK(mentions(misuses, "ncclAllReduce's send buffer lies in host memory"));
}

TEST_CASE(
    "stand-in NCCL: a rank aborted inside a collective takes its part back: a peer arriving later never "
    "touches its freed buffers, and waits until its own abort") {
    ncclUniqueId id{};
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    std::vector<ncclComm_t> comms(2, nullptr);
    {
        std::vector<std::thread> joining;
        for (int r = 0; r < 2; ++r)
            joining.emplace_back([&, r] {
                REQUIRE(cudaSetDevice(r) == cudaSuccess);
                REQUIRE(ncclCommInitRank(&comms[std::size_t(r)], 2, id, r) == ncclSuccess);
            });
        for (auto& t : joining) t.join();
    }
    (void)standin::take_misuses();
    const std::vector<float> ones(4, 1.0f);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    float* first = nullptr;
    REQUIRE(cudaMalloc(&first, sizeof(float) * ones.size()) == cudaSuccess);
    REQUIRE(cudaMemcpy(first, ones.data(), sizeof(float) * ones.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(ncclAllReduce(first, first, ones.size(), ncclFloat32, ncclSum, comms[0], nullptr) == ncclSuccess);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (standin::nccl_parts_waiting(comms[0]) == 0 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
    REQUIRE(standin::nccl_parts_waiting(comms[0]) == 1);  // rank 0's part waits for rank 1's
    REQUIRE(ncclCommAbort(comms[0]) == ncclSuccess);
    REQUIRE(cudaFree(first) == cudaSuccess);  // waits for rank 0's stream, which gave up

    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    float* second = nullptr;
    REQUIRE(cudaMalloc(&second, sizeof(float) * ones.size()) == cudaSuccess);
    REQUIRE(cudaMemcpy(second, ones.data(), sizeof(float) * ones.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(ncclAllReduce(second, second, ones.size(), ncclFloat32, ncclSum, comms[1], nullptr) == ncclSuccess);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(cudaStreamQuery(nullptr) == cudaErrorNotReady);  // waits for a part that was taken back
    REQUIRE(ncclCommAbort(comms[1]) == ncclSuccess);
    REQUIRE(cudaStreamSynchronize(nullptr) == cudaSuccess);
    std::vector<float> after(ones.size());
    REQUIRE(cudaMemcpy(after.data(), second, sizeof(float) * after.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(after == ones);  // never summed with rank 0's freed buffer
    CHECK(cudaFree(second) == cudaSuccess);
    CHECK(standin::take_misuses().empty());
}

TEST_CASE("stand-in NCCL: two ranks on one device are refused as NCCL refuses them") {
    ncclUniqueId id{};
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    std::vector<ncclResult_t> got(2, ncclSuccess);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r)
        ranks.emplace_back([&, r] {
            REQUIRE(cudaSetDevice(0) == cudaSuccess);
            ncclComm_t comm = nullptr;
            got[std::size_t(r)] = ncclCommInitRank(&comm, 2, id, r);
            CHECK(std::string(ncclGetLastError(comm)).find("Duplicate GPU detected") != std::string::npos);
            ncclCommAbort(comm);
        });
    for (auto& t : ranks) t.join();
    CHECK(got == std::vector<ncclResult_t>{ncclInvalidUsage, ncclInvalidUsage});
}

TEST_CASE("stand-in NCCL: an id from ncclGetUniqueId makes one communicator, and a second init with it is a misuse") {
    ncclUniqueId id{};
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    ncclComm_t first = nullptr, second = nullptr;
    ncclResult_t again = ncclSuccess;
    const auto misuses = misuses_of([&] {
        REQUIRE(ncclCommInitRank(&first, 1, id, 0) == ncclSuccess);
        again = ncclCommInitRank(&second, 1, id, 0);
    });
    CHECK(again == ncclRemoteError);
    CHECK(second == nullptr);
    CHECK(std::string(ncclGetLastError(nullptr)).find("serves one initialization") != std::string::npos);
    CHECK(mentions(misuses, "this unique id's communicator was made already"));
    CHECK(ncclCommDestroy(first) == ncclSuccess);
    // A fresh id makes another.
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    CHECK(ncclCommInitRank(&second, 1, id, 0) == ncclSuccess);
    CHECK(ncclCommDestroy(second) == ncclSuccess);
}

TEST_CASE("stand-in NCCL: ncclCommSplit makes a communicator of each colour, ranked by key") {
    constexpr int n = 4;
    ncclUniqueId id{};
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    std::vector<float> sums(n);
    std::vector<int> sizes(n), ranks_in_split(n);
    std::vector<std::thread> ranks;
    for (int r = 0; r < n; ++r)
        ranks.emplace_back([&, r] {
            REQUIRE(cudaSetDevice(r) == cudaSuccess);
            ncclComm_t world = nullptr, half = nullptr;
            REQUIRE(ncclCommInitRank(&world, n, id, r) == ncclSuccess);
            REQUIRE(ncclCommSplit(world, r % 2, -r, &half, nullptr) == ncclSuccess);  // keys reverse the order
            REQUIRE(ncclCommCount(half, &sizes[std::size_t(r)]) == ncclSuccess);
            REQUIRE(ncclCommUserRank(half, &ranks_in_split[std::size_t(r)]) == ncclSuccess);
            float* value = nullptr;
            REQUIRE(cudaMalloc(&value, sizeof(float)) == cudaSuccess);
            const float mine = float(r + 1);
            REQUIRE(cudaMemcpy(value, &mine, sizeof mine, cudaMemcpyHostToDevice) == cudaSuccess);
            REQUIRE(ncclAllReduce(value, value, 1, ncclFloat32, ncclSum, half, nullptr) == ncclSuccess);
            REQUIRE(cudaMemcpy(&sums[std::size_t(r)], value, sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
            CHECK(cudaFree(value) == cudaSuccess);
            CHECK(ncclCommDestroy(half) == ncclSuccess);
            CHECK(ncclCommDestroy(world) == ncclSuccess);
        });
    for (auto& t : ranks) t.join();
    CHECK(sums == std::vector<float>{4, 6, 4, 6});  // 1 + 3 and 2 + 4
    CHECK(sizes == std::vector<int>{2, 2, 2, 2});
    CHECK(ranks_in_split == std::vector<int>{1, 1, 0, 0});  // rank 2 has the lower key (-2) of its pair
}
