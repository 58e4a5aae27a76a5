// The CUDA path. Two suites in one executable, compiled once by nvcc: "host" runs anywhere (error
// reporting, device discovery), "gpu" needs a CUDA device and, without one, reports
// "skipped: no CUDA device" (ctest marks it skipped). bench/gpu-check.sh runs both on a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <gradsync/cuda/check.hpp>
#include <gradsync/cuda/finalize.cuh>
#include <gradsync/cuda/pack.cuh>
#include <gradsync/detail/finalize.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

// Device memory for a test, freed at the end of scope.
template <class T>
struct DeviceArray {
    T* data = nullptr;
    std::size_t size = 0;
    explicit DeviceArray(std::size_t n) : size(n) {
        if (n != 0) GRADSYNC_CUDA_CHECK(cudaMalloc(&data, n * sizeof(T)));
    }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    ~DeviceArray() { cudaFree(data); }
    void upload(const std::vector<T>& host) {
        if (size != 0) GRADSYNC_CUDA_CHECK(cudaMemcpy(data, host.data(), size * sizeof(T), cudaMemcpyHostToDevice));
    }
    std::vector<T> download() const {
        std::vector<T> host(size);
        if (size != 0) GRADSYNC_CUDA_CHECK(cudaMemcpy(host.data(), data, size * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
};

// Bitwise equality (NaN payloads, -0.0 and 16-bit values included).
template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Packs tensors of the given sizes (one element of slack before each, so that most start
// unaligned) into a bucket on the device and back, against the host's copy.
template <class T>
void check_pack_round_trip(const std::vector<std::size_t>& sizes) {
    std::size_t storage = 0;
    for (auto n : sizes) storage += n + 1;
    std::vector<T> host(storage);
    std::mt19937 rng(11);
    for (auto& v : host) {
        const auto bits = rng();
        std::memcpy(&v, &bits, std::min(sizeof v, sizeof bits));
    }
    DeviceArray<T> tensors(storage);
    tensors.upload(host);
    std::vector<gradsync::cuda::Segment> table;
    std::vector<T> expected;
    std::size_t at = 0;
    for (auto n : sizes) {
        ++at;  // the slack element
        table.push_back({tensors.data + at, n, expected.size()});
        expected.insert(expected.end(), host.begin() + std::ptrdiff_t(at), host.begin() + std::ptrdiff_t(at + n));
        at += n;
    }
    DeviceArray<gradsync::cuda::Segment> device_table(table.size());
    device_table.upload(table);
    DeviceArray<T> bucket(expected.size());
    gradsync::cuda::pack<T>({device_table.data, device_table.size}, bucket.data, expected.size(), nullptr);
    GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
    const auto packed = bucket.download();
    CHECK(same_bytes(packed, expected));

    // Unpack a changed bucket: the tensors take its values, the slack elements keep theirs.
    std::vector<T> changed(expected.size());
    for (auto& v : changed) {
        const auto bits = rng();
        std::memcpy(&v, &bits, std::min(sizeof v, sizeof bits));
    }
    bucket.upload(changed);
    gradsync::cuda::unpack<T>({device_table.data, device_table.size}, bucket.data, changed.size(), nullptr);
    GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
    auto after = tensors.download();
    std::vector<T> want = host;
    std::size_t k = 0;
    for (const auto& s : table) {
        const std::size_t first = std::size_t(static_cast<T*>(s.data) - tensors.data);
        for (std::size_t i = 0; i < s.count; ++i) want[first + i] = changed[k++];
    }
    CHECK(same_bytes(after, want));
}

template <class T>
void check_pack_sizes() {
    check_pack_round_trip<T>({});
    check_pack_round_trip<T>({0});
    check_pack_round_trip<T>({1});
    check_pack_round_trip<T>({0, 3, 0, 1, 8191, 8192, 8193});
    std::vector<std::size_t> many(2000, 7);  // many small tensors, one launch
    check_pack_round_trip<T>(many);
    check_pack_round_trip<T>({std::size_t(3) << 20});  // one tensor over many blocks
}

// The device pass against the host's (detail/finalize.hpp): the same values written, bit for bit,
// and the same sum of squares up to summation order; the same sum again on a second run.
template <class T>
void check_finalize(std::size_t n, double factor, bool poison = false) {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> value(-4.0f, 4.0f);
    std::vector<T> host(n);
    for (auto& v : host) v = T(value(rng));
    if (poison && n > 0) host[n / 2] = T(INFINITY);
    std::vector<T> expected = host;
    gradsync::detail::SquareSum sums;
    gradsync::detail::scale_square_sum(expected.data(), n, factor, sums);

    gradsync::cuda::FinalizeScratch scratch;
    DeviceArray<T> data(n);
    double sum[2] = {};
    for (double& s : sum) {
        data.upload(host);
        gradsync::cuda::finalize<T>(data.data, n, factor, scratch, nullptr);
        GRADSYNC_CUDA_CHECK(cudaMemcpy(&s, scratch.sum(), sizeof s, cudaMemcpyDeviceToHost));
    }
    const auto written = data.download();
    CHECK(same_bytes(written, expected));
    if (poison) {
        CHECK_FALSE(std::isfinite(sum[0]));
    } else {
        CHECK(sum[0] == doctest::Approx(sums.total()).epsilon(1e-12));
    }
    CHECK(std::memcmp(&sum[0], &sum[1], sizeof(double)) == 0);  // deterministic
}

template <class T>
void check_finalize_sizes() {
    for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(255), std::size_t(256), std::size_t(257),
                          (std::size_t(1) << 20) + 3}) {
        CAPTURE(n);
        check_finalize<T>(n, 1.0 / 6.0);
        check_finalize<T>(n, 1.0);
    }
    check_finalize<T>(100'000, 0.5, /*poison=*/true);
}

}  // namespace

TEST_SUITE("host") {
    TEST_CASE("a failed CUDA call is a CudaError naming the call, the place and CUDA's words") {
        std::string what;
        cudaError_t code = cudaSuccess;
        try {
            GRADSYNC_CUDA_CHECK(cudaSetDevice(-1));
        } catch (const gradsync::CudaError& e) {
            what = e.what();
            code = e.code();
        }
        CHECK(code != cudaSuccess);
        CHECK(what.find("gradsync: cudaSetDevice(-1) failed at ") != std::string::npos);
        CHECK(what.find("test_cuda.cu:") != std::string::npos);
        CHECK(what.find(cudaGetErrorName(code)) != std::string::npos);
    }

    TEST_CASE("cuda_devices: a count, or zero with the reason") {
        const auto devices = gradsync::cuda_devices();
        CHECK(devices.count >= 0);
        if (devices.count == 0) CHECK(devices.why.find("no CUDA device") == 0);
        if (devices.count > 0) CHECK(devices.why.empty());
    }
}

TEST_SUITE("gpu") {
    TEST_CASE("pack and unpack: one launch per bucket, every element size, awkward sizes, unaligned tensors") {
        check_pack_sizes<std::uint16_t>();  // float16, bfloat16
        check_pack_sizes<float>();
        check_pack_sizes<double>();
    }

    TEST_CASE("finalize: scale in place and sum of squares in one pass, as the host does, deterministic") {
        check_finalize_sizes<float>();
        check_finalize_sizes<double>();
        check_finalize_sizes<gradsync::float16>();
        check_finalize_sizes<gradsync::bfloat16>();
    }
}

int main(int argc, char** argv) {
    doctest::Context context(argc, argv);
    context.setOption("no-colors", true);
    // The GPU suite without a GPU: skipped, with the reason, before any test runs.
    bool gpu_suite = false;
    for (int i = 1; i < argc; ++i) gpu_suite = gpu_suite || std::strcmp(argv[i], "--test-suite=gpu") == 0;
    if (gpu_suite) {
        const auto devices = gradsync::cuda_devices();
        if (devices.count == 0) {
            std::printf("skipped: %s\n", devices.why.c_str());
            return 0;
        }
    }
    return context.run();
}
