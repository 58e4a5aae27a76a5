// CudaMemory: the memory policy for gradients in device memory, under NcclBackend. Bucket
// buffers are device memory, and every pass DataParallel makes over gradient memory is a kernel
// queued on the trainer's compute stream, without the host waiting: pack and unpack in one launch
// per bucket from a device-side table of its tensors; the finalize pass (unpack, scale by
// 1 / (world size x loss scale), sum of squares) in one read and one write, one launch. Each
// bucket's sum of squares lands in device memory and all are read back at once, when a step
// needs them (step(), a loss scaler, clipping): the one host synchronization of such a step.
//
//   gradsync::NcclBackend<> backend(place, {.compute_stream = stream});
//   gradsync::DataParallel dp(model, backend, gradsync::CudaMemory{stream});
//
// Needs nvcc. Not yet: wire compression on the device (fp16/bf16 kernels), vectorized loads.
#pragma once

#include <gradsync/backend.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/cuda/bucket_table.hpp>
#include <gradsync/cuda/check.hpp>
#include <gradsync/cuda/finalize.cuh>
#include <gradsync/cuda/pack.cuh>
#include <gradsync/detail/policy.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>  // for std::exchange
#include <vector>

namespace gradsync::inline v0 {

namespace cuda {

// Device memory owned by one object; size() in bytes.
class DeviceBytes {
public:
    DeviceBytes() = default;
    explicit DeviceBytes(std::size_t bytes) : size_(bytes) {
        if (bytes != 0) GRADSYNC_CUDA_CHECK(cudaMalloc(&data_, bytes));
    }
    DeviceBytes(DeviceBytes&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
    DeviceBytes& operator=(DeviceBytes&& o) noexcept {
        if (this != &o) {
            cudaFree(data_);
            data_ = std::exchange(o.data_, nullptr);
            size_ = std::exchange(o.size_, 0);
        }
        return *this;
    }
    DeviceBytes(const DeviceBytes&) = delete;
    DeviceBytes& operator=(const DeviceBytes&) = delete;
    ~DeviceBytes() { cudaFree(data_); }

    [[nodiscard]] std::byte* data() const { return static_cast<std::byte*>(data_); }
    [[nodiscard]] std::size_t size() const { return size_; }

private:
    void* data_ = nullptr;
    std::size_t size_ = 0;
};

namespace detail {

// Walks the bucket's tiles, block b taking tiles b, b + gridDim.x, ... (a grid that depends on
// the bucket's size only, so the sum is the same on every GPU): each tensor element becomes
// T(source * factor), from the packed bucket when there is one, else from the tensor itself
// (in place), and its square, as written, joins the sum. `write` false only measures.
template <class T>
__global__ void __launch_bounds__(finalize_threads)
    table_finalize_kernel(const Segment* table, std::size_t segments, const T* bucket, std::uint64_t total,
                          device_accumulator_t<T> factor, bool write, double* block_sums, unsigned* ticket,
                          double* sum) {
    double squares = 0;
    for (std::uint64_t tile = blockIdx.x; tile * pack_tile < total; tile += gridDim.x) {
        const std::uint64_t begin = tile * pack_tile;
        const std::uint64_t end = begin + pack_tile < total ? begin + pack_tile : total;
        for_each_piece(table, segments, begin, end,
                       [&](std::size_t s, std::uint64_t in_tensor, std::uint64_t in_bucket, std::uint64_t n) {
                           T* tensor = static_cast<T*>(table[s].data) + in_tensor;
                           const T* source = bucket != nullptr ? bucket + in_bucket : tensor;
                           for (std::uint64_t i = threadIdx.x; i < n; i += blockDim.x) {
                               const T written = write ? narrow<T>(widen(source[i]) * factor) : source[i];
                               if (write) tensor[i] = written;
                               const double w = static_cast<double>(widen(written));
                               squares += w * w;
                           }
                       });
    }
    sum_over_blocks(squares, block_sums, ticket, sum);
}

// One block per tensor: the sum of the squares of each, into sums[s].
template <class T>
__global__ void __launch_bounds__(finalize_threads) segment_squares_kernel(const Segment* table, double* sums) {
    const Segment& s = table[blockIdx.x];
    const T* data = static_cast<const T*>(s.data);
    double squares = 0;
    for (std::uint64_t i = threadIdx.x; i < s.count; i += blockDim.x) {
        const double w = static_cast<double>(widen(data[i]));
        squares += w * w;
    }
    using BlockReduce = cub::BlockReduce<double, finalize_threads>;
    __shared__ typename BlockReduce::TempStorage temp;
    const double total = BlockReduce(temp).Sum(squares);
    if (threadIdx.x == 0) sums[blockIdx.x] = total;
}

// Calls f(T{}) with the CUDA-side type of a floating-point dtype.
template <class F>
void visit_dtype(DType t, F&& f) {
    switch (t) {
        case DType::float32: return f(float{});
        case DType::float64: return f(double{});
        case DType::float16: return f(float16{});
        case DType::bfloat16: return f(bfloat16{});
        default: throw Error("gradsync: CudaMemory: " + to_string(t) + " gradients are not supported");
    }
}

}  // namespace detail

}  // namespace cuda

class CudaMemory {
public:
    using policy_category = policy_category::memory;
    using Storage = cuda::DeviceBytes;
    static constexpr bool on_device = true;

    // A bucket's gradients: the table of its tensors in device memory (for the kernels) and on
    // the host (for zeroing and naming).
    struct Table {
        std::shared_ptr<cuda::DeviceBytes> device;  // cuda::Segment[segments]
        std::vector<Segment> host;
        std::uint64_t total = 0;
        DType dtype = DType::float32;

        [[nodiscard]] std::span<const cuda::Segment> entries() const {
            return {reinterpret_cast<const cuda::Segment*>(device ? device->data() : nullptr), host.size()};
        }
    };

    // Kernels go on `stream`: the stream the trainer's backward runs on (NcclOptions::compute_stream).
    explicit CudaMemory(cudaStream_t stream = nullptr) : stream_(stream), state_(std::make_shared<State>()) {}

    [[nodiscard]] cudaStream_t stream() const { return stream_; }

    Storage allocate(Bytes size) const { return Storage(size.count()); }
    static std::byte* data(const Storage& s) { return s.data(); }

    Table table(std::span<const Segment> segments, DType t) const {
        Table out;
        out.dtype = t;
        out.host.assign(segments.begin(), segments.end());
        std::vector<cuda::Segment> entries;
        for (const auto& s : segments) {
            entries.push_back(cuda::Segment{s.data, s.count, out.total});
            out.total += s.count;
        }
        out.device = std::make_shared<cuda::DeviceBytes>(entries.size() * sizeof(cuda::Segment));
        if (!entries.empty())
            GRADSYNC_CUDA_CHECK(
                cudaMemcpy(out.device->data(), entries.data(), out.device->size(), cudaMemcpyHostToDevice));
        return out;
    }

    void pack(const Table& t, std::byte* dst) const { copy<true>(t, dst); }
    void unpack(const Table& t, const std::byte* src) const { copy<false>(t, const_cast<std::byte*>(src)); }

    void compress(const Table&, std::byte*, DType, double) const { not_built("wire compression"); }
    bool all_finite(const std::byte*, std::size_t) const { not_built("wire compression"); }

    void prepare_results(std::size_t slots) {
        state_->results = cuda::DeviceBytes((slots + 1) * sizeof(double));  // the last: for scale()
        state_->host.assign(slots, 0.0);
        GRADSYNC_CUDA_CHECK(cudaMemsetAsync(state_->results.data(), 0, state_->results.size(), stream_));
    }

    // One launch: the tensors = `src` (the reduced bucket; null: the tensors themselves) times
    // `factor`, and the sum of the squares written into result slot `slot` on the device.
    void finalize(const Table& t, const std::byte* src, DType src_type, double factor, std::size_t slot) {
        if (src != nullptr && src_type != t.dtype) not_built("wire compression");
        launch_finalize(t, src, factor, src != nullptr || factor != 1.0, result(slot));
    }

    // Reads every result slot back: waits for the stream (the step's one host synchronization).
    std::span<const double> results() {
        auto& s = *state_;
        if (!s.host.empty()) {
            GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(s.host.data(), s.results.data(), s.host.size() * sizeof(double),
                                                cudaMemcpyDeviceToHost, stream_));
            GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream_));
        }
        return s.host;
    }

    std::vector<double> segment_sums(const Table& t) const {
        std::vector<double> out(t.host.size());
        if (out.empty()) return out;
        cuda::DeviceBytes sums(out.size() * sizeof(double));
        cuda::detail::visit_dtype(t.dtype, [&]<class T>(T) {
            cuda::detail::segment_squares_kernel<T><<<unsigned(out.size()), cuda::finalize_threads, 0, stream_>>>(
                t.entries().data(), reinterpret_cast<double*>(sums.data()));
        });
        GRADSYNC_CUDA_CHECK(cudaGetLastError());
        GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(out.data(), sums.data(), sums.size(), cudaMemcpyDeviceToHost, stream_));
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream_));
        return out;
    }

    // Clipping's second pass: one launch per bucket (its sum goes to a slot nobody reads).
    void scale(const Table& t, double factor) const {
        launch_finalize(t, nullptr, factor, true, result(state_->host.size()));
    }

    void zero(Segment s, DType t) const {
        GRADSYNC_CUDA_CHECK(cudaMemsetAsync(s.data, 0, s.count * size_of(t), stream_));
    }

private:
    struct State {
        cuda::FinalizeScratch scratch;
        cuda::DeviceBytes results;  // double per slot, on the device
        std::vector<double> host;   // the slots as last read back
    };

    [[noreturn]] static void not_built(const char* what) {
        throw Error(std::string("gradsync: CudaMemory: ") + what + " on the device is not built yet");
    }

    [[nodiscard]] double* result(std::size_t slot) const {
        return reinterpret_cast<double*>(state_->results.data()) + slot;
    }

    void launch_finalize(const Table& t, const std::byte* src, double factor, bool write, double* sum) const {
        const std::uint64_t tiles = (t.total + cuda::pack_tile - 1) / cuda::pack_tile;
        const unsigned blocks = tiles == 0                      ? 1u
                                : tiles < cuda::finalize_blocks ? unsigned(tiles)
                                                                : cuda::finalize_blocks;
        auto& scratch = state_->scratch;
        cuda::detail::visit_dtype(t.dtype, [&]<class T>(T) {
            cuda::detail::table_finalize_kernel<T><<<blocks, cuda::finalize_threads, 0, stream_>>>(
                t.entries().data(), t.host.size(), reinterpret_cast<const T*>(src), t.total,
                static_cast<cuda::detail::device_accumulator_t<T>>(factor), write, scratch.block_sums(),
                scratch.ticket(), sum);
        });
        GRADSYNC_CUDA_CHECK(cudaGetLastError());
    }

    template <bool to_bucket>
    void copy(const Table& t, std::byte* bucket) const {
        switch (size_of(t.dtype)) {
            case 2:
                return cuda::detail::launch_copy<std::uint16_t, to_bucket>(
                    t.entries(), reinterpret_cast<std::uint16_t*>(bucket), t.total, stream_);
            case 4:
                return cuda::detail::launch_copy<float, to_bucket>(t.entries(), reinterpret_cast<float*>(bucket),
                                                                   t.total, stream_);
            default:
                return cuda::detail::launch_copy<double, to_bucket>(t.entries(), reinterpret_cast<double*>(bucket),
                                                                    t.total, stream_);
        }
    }

    cudaStream_t stream_ = nullptr;
    std::shared_ptr<State> state_;
};

}  // namespace gradsync::inline v0
