// The 784-512-10 MLP of mlp.hpp as a CUDA trainer (cuBLAS for the matrix products, small kernels
// for the rest), made data-parallel over GPUs with NcclBackend. Parameters live in one device
// buffer and gradients in another, in registration order, so DataParallel reduces each bucket
// where it lies. Two ways to start it:
//
//   train_mlp_nccl                   one process, one thread per visible GPU (nccl_spawn)
//   torchrun --nproc-per-node=N train_mlp_nccl   one process per GPU, from RANK, WORLD_SIZE,
//                                    LOCAL_RANK, MASTER_ADDR and MASTER_PORT
//   train_mlp_nccl --local-ranks N   N ranks (2 to 8) sharing GPU 0, over CudaLocalBackend: the
//                                    same device path where there is only one GPU
//
// Every rank prints a checksum of its parameters at the end: they are the same on every rank.
#include "mlp.hpp"  // the synthetic data

#include <gradsync/backend/nccl.hpp>
#include <gradsync/launch/nccl_spawn.hpp>
#include <gradsync/model/contiguous_parameters.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/backend/cuda_local.cuh>
#include <gradsync/memory/cuda.cuh>
#include <gradsync/data_parallel.hpp>

#include <cublas_v2.h>

#include <cstdio>
#include <cstdlib>  // for std::getenv, std::atoi
#include <cstring>  // for std::strcmp
#include <stdexcept>
#include <vector>

namespace {

constexpr int steps = 20;
constexpr int batch = 32;  // examples per step and rank
constexpr float learning_rate = 0.05f;
constexpr int in = 784, hidden = 512, out = 10;
constexpr std::size_t sizes[] = {std::size_t(in) * hidden, hidden, std::size_t(hidden) * out, out};
constexpr std::size_t total = sizes[0] + sizes[1] + sizes[2] + sizes[3];

#define CUBLAS_CHECK(call)                                                                              \
    do {                                                                                                \
        if (const cublasStatus_t status = (call); status != CUBLAS_STATUS_SUCCESS)                      \
            throw std::runtime_error(std::string(#call) + " failed: " + cublasGetStatusString(status)); \
    } while (0)

dim3 grid_for(std::size_t n) { return dim3(unsigned((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024)); }

__global__ void add_bias(float* rows, const float* bias, int n_rows, int width, bool relu) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_rows * width; i += gridDim.x * blockDim.x) {
        const float v = rows[i] + bias[i % width];
        rows[i] = relu ? fmaxf(v, 0.0f) : v;
    }
}

// Softmax cross-entropy per sample: the loss summed into *loss, the gradient of the mean loss.
__global__ void softmax_cross_entropy(const float* logits, const int* labels, float* dlogits, float* loss, int n) {
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= n) return;
    const float* l = logits + s * out;
    float top = l[0], sum = 0;
    for (int k = 1; k < out; ++k) top = fmaxf(top, l[k]);
    for (int k = 0; k < out; ++k) sum += expf(l[k] - top);
    for (int k = 0; k < out; ++k) {
        const float p = expf(l[k] - top) / sum;
        dlogits[s * out + k] = (p - (k == labels[s] ? 1.0f : 0.0f)) / float(n);
    }
    atomicAdd(loss, -logf(expf(l[labels[s]] - top) / sum));
}

// Column sums of a row-major n_rows x width matrix: a bias gradient.
__global__ void column_sums(const float* rows, float* sums, int n_rows, int width) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x) {
        float s = 0;
        for (int r = 0; r < n_rows; ++r) s += rows[r * width + c];
        sums[c] = s;
    }
}

__global__ void relu_backward(float* grad, const float* activation, std::size_t n) {
    for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
         i += std::size_t(gridDim.x) * blockDim.x)
        if (activation[i] <= 0.0f) grad[i] = 0.0f;
}

__global__ void sgd(float* params, const float* grads, std::size_t n, float lr) {
    for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
         i += std::size_t(gridDim.x) * blockDim.x)
        params[i] -= lr * grads[i];
}

// Row-major C (m x n) = op(A) op(B) through column-major cuBLAS: C^T = op(B)^T op(A)^T.
void gemm(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb,
          float* c, int ldc) {
    const float one = 1, zero = 0;
    CUBLAS_CHECK(cublasSgemm(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &one, b, ldb,
                             a, lda, &zero, c, ldc));
}

template <class T>
T* device_alloc(std::size_t n) {
    T* p = nullptr;
    GRADSYNC_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    return p;
}

template <class Backend>
void train(Backend& backend, cudaStream_t stream) {
    // Parameters w1 (in x hidden), b1, w2 (hidden x out), b2, initialized as mlp::Mlp does.
    std::vector<float> host(total, 0.0f);
    mlp::Mlp reference(/*seed=*/1);
    std::copy(reference.w1.begin(), reference.w1.end(), host.begin());
    std::copy(reference.w2.begin(), reference.w2.end(), host.begin() + std::ptrdiff_t(sizes[0] + sizes[1]));
    float* params = device_alloc<float>(total);
    float* grads = device_alloc<float>(total);
    GRADSYNC_CUDA_CHECK(cudaMemcpy(params, host.data(), total * sizeof(float), cudaMemcpyHostToDevice));
    float *w1 = params, *b1 = w1 + sizes[0], *w2 = b1 + sizes[1], *b2 = w2 + sizes[2];
    float *gw1 = grads, *gb1 = gw1 + sizes[0], *gw2 = gb1 + sizes[1], *gb2 = gw2 + sizes[2];
    float* x = device_alloc<float>(std::size_t(batch) * in);
    int* labels = device_alloc<int>(batch);
    float* h = device_alloc<float>(std::size_t(batch) * hidden);
    float* dh = device_alloc<float>(std::size_t(batch) * hidden);
    float* logits = device_alloc<float>(std::size_t(batch) * out);
    float* dlogits = device_alloc<float>(std::size_t(batch) * out);
    float* loss = device_alloc<float>(1);
    cublasHandle_t blas = nullptr;
    CUBLAS_CHECK(cublasCreate(&blas));
    CUBLAS_CHECK(cublasSetStream(blas, stream));

    // [nccl-train]
    static constexpr std::string_view names[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
    gradsync::ContiguousParameters<float> model(params, grads, sizes, names);
    // Rank 0's parameters reach every rank; the passes over gradients are kernels on `stream`.
    gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream});
    // [/nccl-train]
    const int rank = backend.rank(), world = backend.size();
    for (int step = 0; step < steps; ++step) {
        const auto data = mlp::make_batch(/*seed=*/7, std::size_t(step * world + rank) * batch, batch);
        GRADSYNC_CUDA_CHECK(
            cudaMemcpyAsync(x, data.images.data(), data.images.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
        GRADSYNC_CUDA_CHECK(
            cudaMemcpyAsync(labels, data.labels.data(), batch * sizeof(int), cudaMemcpyHostToDevice, stream));
        GRADSYNC_CUDA_CHECK(cudaMemsetAsync(loss, 0, sizeof(float), stream));
        // Forward.
        gemm(blas, false, false, batch, hidden, in, x, in, w1, hidden, h, hidden);
        add_bias<<<grid_for(std::size_t(batch) * hidden), 256, 0, stream>>>(h, b1, batch, hidden, true);
        gemm(blas, false, false, batch, out, hidden, h, hidden, w2, out, logits, out);
        add_bias<<<1, 256, 0, stream>>>(logits, b2, batch, out, false);
        softmax_cross_entropy<<<1, batch, 0, stream>>>(logits, labels, dlogits, loss, batch);
        // Backward, layer 2 first; each gradient is handed to gradsync once its kernels are queued.
        gemm(blas, true, false, hidden, out, batch, h, hidden, dlogits, out, gw2, out);
        column_sums<<<1, 256, 0, stream>>>(dlogits, gb2, batch, out);
        dp.grad_ready(3);
        dp.grad_ready(2);
        gemm(blas, false, true, batch, hidden, out, dlogits, out, w2, out, dh, hidden);
        relu_backward<<<grid_for(std::size_t(batch) * hidden), 256, 0, stream>>>(dh, h, std::size_t(batch) * hidden);
        gemm(blas, true, false, in, hidden, batch, x, in, dh, hidden, gw1, hidden);
        column_sums<<<2, 256, 0, stream>>>(dh, gb1, batch, hidden);
        dp.grad_ready(1);
        dp.grad_ready(0);
        // The stream waits for the averaged gradients, then measures them (the host waits for that
        // norm: step() decides on it), then runs the optimizer.
        const auto report =
            dp.step([&] { sgd<<<grid_for(total), 256, 0, stream>>>(params, grads, total, learning_rate); });
        if (rank == 0) {
            float l = 0;  // read back for the printout only
            GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(&l, loss, sizeof l, cudaMemcpyDeviceToHost, stream));
            GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
            std::printf("step %2d  loss %.4f  gradient norm %.4f\n", step, l / batch, report.grad_norm);
        }
    }
    GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(host.data(), params, total * sizeof(float), cudaMemcpyDeviceToHost, stream));
    GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
    double checksum = 0;
    for (std::size_t i = 0; i < total; ++i) checksum += double(host[i]) * double(i % 101 + 1);
    std::printf("rank %d of %d: parameter checksum %.9e\n", rank, world, checksum);
    cublasDestroy(blas);
    for (void* p : {static_cast<void*>(params), static_cast<void*>(grads), static_cast<void*>(x),
                    static_cast<void*>(labels), static_cast<void*>(h), static_cast<void*>(dh),
                    static_cast<void*>(logits), static_cast<void*>(dlogits), static_cast<void*>(loss)})
        cudaFree(p);
}

// The trainer's stream, made before the backend so that the backend orders its collectives after it.
struct Stream {
    cudaStream_t s = nullptr;
    Stream() { GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
    ~Stream() { cudaStreamDestroy(s); }
};

}  // namespace

int main(int argc, char** argv) {
    try {
        if (argc == 3 && std::strcmp(argv[1], "--local-ranks") == 0) {
            gradsync::cuda_local_spawn(std::atoi(argv[2]), [](gradsync::CudaLocalBackend& backend) {
                Stream stream;
                backend.set_compute_stream(stream.s);
                train(backend, stream.s);
            });
            return 0;
        }
        // [nccl-launch]
        if (std::getenv("RANK") != nullptr || std::getenv("OMPI_COMM_WORLD_RANK") != nullptr) {
            const auto place = gradsync::nccl_place_from_environment();  // one process per GPU
            GRADSYNC_CUDA_CHECK(cudaSetDevice(place.device));
            Stream stream;
            gradsync::NcclBackend<> backend(place, gradsync::NcclOptions{.compute_stream = stream.s});
            train(backend, stream.s);
        } else {
            const auto devices = gradsync::cuda_devices();
            if (devices.count == 0) throw gradsync::Error("gradsync: train_mlp_nccl needs a GPU: " + devices.why);
            gradsync::nccl_spawn(devices.count, [](gradsync::NcclBackend<>& backend) {
                Stream stream;  // on this thread's GPU, which nccl_spawn made current
                backend.set_compute_stream(stream.s);
                train(backend, stream.s);
            });
        }
        // [/nccl-launch]
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 1;
    }
    return 0;
}
