// Host references for the CUDA tests' own kernels (test_cuda.cu, test_sharded_on_device.cu,
// test_hooks_on_device.cu), for their run on the stand-in CUDA runtime (tests/standin): what each
// writes, on the stream's thread.
#include "../standin/kernels.hpp"

#include <gradsync/memory/policy.hpp>

#include <chrono>
#include <cstddef>
#include <thread>

namespace test_kernels {
__global__ void late_fill(float* data, std::size_t n, float value, long long cycles);
__global__ void count_if_finite(const gradsync::StepVerdict* verdict, int* applied);
__global__ void add_one(float* data, std::size_t n);
__global__ void sgd(float* p, const float* g, std::size_t n, float lr);
__global__ void spin(long long cycles);
}  // namespace test_kernels

namespace {

[[maybe_unused]] const bool registered = [] {
    // late_fill spins `cycles` clock cycles first: about that many nanoseconds at 2 GHz, halved.
    standin::on_kernel(&test_kernels::late_fill, "late_fill",
                       [](dim3, dim3, float* data, std::size_t n, float value, long long cycles) {
                           std::this_thread::sleep_for(std::chrono::nanoseconds(cycles / 2));
                           for (std::size_t i = 0; i < n; ++i) data[i] = value;
                       });
    standin::on_kernel(&test_kernels::count_if_finite, "count_if_finite",
                       [](dim3, dim3, const gradsync::StepVerdict* verdict, int* applied) {
                           if (verdict->finite != 0) ++*applied;
                       });
    standin::on_kernel(&test_kernels::add_one, "add_one", [](dim3, dim3, float* data, std::size_t n) {
        for (std::size_t i = 0; i < n; ++i) data[i] += 1.0f;
    });
    standin::on_kernel(&test_kernels::sgd, "sgd", [](dim3, dim3, float* p, const float* g, std::size_t n, float lr) {
        for (std::size_t i = 0; i < n; ++i) p[i] -= lr * g[i];
    });
    standin::on_kernel(&test_kernels::spin, "spin", [](dim3, dim3, long long cycles) {
        std::this_thread::sleep_for(std::chrono::nanoseconds(cycles / 2));
    });
    return true;
}();

}  // namespace
