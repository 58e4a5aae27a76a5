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
// Wire compression (NoCompression's float16 and bfloat16 twins) packs and converts in one launch;
// a float16 sum that overflowed is found on the device and leaves the gradients untouched, so
// DataParallel can reduce the bucket again in float32. Needs nvcc.
#pragma once

#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/memory/cuda/bucket_table.hpp>
#include <gradsync/memory/cuda/device_bytes.cuh>
#include <gradsync/cuda/check.hpp>
#include <gradsync/memory/cuda/finalize.cuh>
#include <gradsync/memory/cuda/pack.cuh>
#include <gradsync/detail/dtype_visit.hpp>
#include <gradsync/detail/policy.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>
#include <gradsync/memory/policy.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>  // for std::is_same_v
#include <vector>

namespace gradsync::inline v0 {

namespace cuda {

namespace detail {

// Walks the bucket's tiles, block b taking tiles b, b + gridDim.x, ... (a grid that depends on
// the bucket's size only, so the sum is the same on every GPU): each tensor element becomes
// T(source * factor), from the packed bucket of S when there is one, else from the tensor itself
// (in place, S = T), and its square, as written, joins the sum. `write` false only measures. When
// *skip is set (a float16 wire that overflowed), nothing is written and the sum is NaN.
template <class S, class T>
__global__ void __launch_bounds__(finalize_threads)
    table_finalize_kernel(const Segment* table, std::size_t segments, const S* bucket, std::uint64_t total,
                          device_accumulator_t<T> factor, bool write, const unsigned* skip, double* block_sums,
                          unsigned* ticket, double* sum) {
    if (skip != nullptr && *skip != 0) {
        if (blockIdx.x == 0 && threadIdx.x == 0) *sum = __longlong_as_double(0x7ff8000000000000ll);
        return;
    }
    double squares = 0;
    for (std::uint64_t tile = blockIdx.x; tile * pack_tile < total; tile += gridDim.x) {
        const std::uint64_t begin = tile * pack_tile;
        const std::uint64_t end = begin + pack_tile < total ? begin + pack_tile : total;
        for_each_piece(table, segments, begin, end,
                       [&](std::size_t s, std::uint64_t in_tensor, std::uint64_t in_bucket, std::uint64_t n) {
                           T* tensor = static_cast<T*>(table[s].data) + in_tensor;
                           finalize_range<S, T>(tensor, bucket != nullptr ? bucket + in_bucket : nullptr, n, factor,
                                                write, threadIdx.x, blockDim.x, squares);
                       });
    }
    sum_over_blocks(squares, block_sums, ticket, sum);
}

// The tensors (of T) into the bucket as W, each times `factor` in float, one launch: float32 ones
// onto a 16-bit wire (compression), or 16-bit ones widened into float32 (for a hook).
template <class T, class W>
__global__ void table_compress_kernel(const Segment* table, std::size_t segments, W* bucket, std::uint64_t total,
                                      float factor) {
    const std::uint64_t begin = std::uint64_t(blockIdx.x) * pack_tile;
    const std::uint64_t end = begin + pack_tile < total ? begin + pack_tile : total;
    for_each_piece(table, segments, begin, end,
                   [&](std::size_t s, std::uint64_t in_tensor, std::uint64_t in_bucket, std::uint64_t n) {
                       const T* tensor = static_cast<const T*>(table[s].data) + in_tensor;
                       for (std::uint64_t i = threadIdx.x; i < n; i += blockDim.x) {
                           const float value = float(widen(tensor[i])) * factor;
                           if constexpr (std::is_same_v<W, float>)
                               bucket[in_bucket + i] = value;
                           else
                               bucket[in_bucket + i] = narrow<W>(value);
                       }
                   });
}

// Sets *flag when one of n float16 values is an infinity or NaN (an exponent of all ones). A
// template only so that a header may define it.
template <class = void>
__global__ void nonfinite_float16_kernel(const float16* data, std::uint64_t n, unsigned* flag) {
    bool found = false;
    for (std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += std::uint64_t(gridDim.x) * blockDim.x)
        found = found || (data[i].bits & 0x7c00u) == 0x7c00u;
    if (__syncthreads_or(found) && threadIdx.x == 0) *flag = 1;
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

// Adds the slots in order into the verdict, on the device. A template only so that a header may
// define it.
template <class = void>
__global__ void verdict_kernel(const double* slots, std::size_t n, StepVerdict* verdict) {
    double sum = 0;
    for (std::size_t i = 0; i < n; ++i) sum += slots[i];
    verdict->sum_squares = sum;
    verdict->finite = isfinite(sum) ? 1 : 0;
}

}  // namespace detail

}  // namespace cuda

class CudaMemory {
public:
    using policy_category = policy_category::memory;
    using Storage = cuda::DeviceBytes;
    static constexpr bool on_device = true;
    [[nodiscard]] std::string settings() const { return "device"; }

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
    // Every pass selects the stream's device first, whatever device the calling thread has current.
    explicit CudaMemory(cudaStream_t stream = nullptr) : stream_(stream), device_(gradsync::detail::device_of(stream)) {
        gradsync::detail::DeviceScope scope(device_);
        state_ = std::make_shared<State>();
    }

    [[nodiscard]] cudaStream_t stream() const { return stream_; }

    Storage allocate(Bytes size) const {
        gradsync::detail::DeviceScope scope(device_);
        return Storage(size.count());
    }
    static std::byte* data(const Storage& s) { return s.data(); }

    // Made during backward where gradients move: the upload and the allocation are ordered on the
    // stream (and the table a new one replaces is freed there), so no pass waits for the device.
    Table table(std::span<const Segment> segments, DType t) const {
        gradsync::detail::DeviceScope scope(device_);
        Table out;
        out.dtype = t;
        out.host.assign(segments.begin(), segments.end());
        std::vector<cuda::Segment> entries;
        for (const auto& s : segments) {
            entries.push_back(cuda::Segment{s.data, s.count, out.total});
            out.total += s.count;
        }
        out.device = std::make_shared<cuda::DeviceBytes>(entries.size() * sizeof(cuda::Segment), stream_);
        // From pageable memory: staged before the call returns, so `entries` may go at once.
        if (!entries.empty())
            GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(out.device->data(), entries.data(), out.device->size(),
                                                cudaMemcpyHostToDevice, stream_));
        return out;
    }

    void pack(const Table& t, std::byte* dst) const { copy<true>(t, dst); }
    void unpack(const Table& t, const std::byte* src) const { copy<false>(t, const_cast<std::byte*>(src)); }

    // The gradients into `dst` as `wire` values times `factor`: float32 ones onto a 16-bit wire
    // (compression), or float16 and bfloat16 ones widened into float32 (a hook's copy).
    void compress(const Table& t, std::byte* dst, DType wire, double factor) const {
        gradsync::detail::DeviceScope scope(device_);
        if (t.total == 0) return;
        const unsigned blocks = unsigned((t.total + cuda::pack_tile - 1) / cuda::pack_tile);
        const auto f = static_cast<float>(factor);
        const auto launch = [&]<class T, class W>(gradsync::detail::type_tag<T>, gradsync::detail::type_tag<W>) {
            cuda::detail::table_compress_kernel<T, W><<<blocks, cuda::pack_threads, 0, stream_>>>(
                t.entries().data(), t.host.size(), reinterpret_cast<W*>(dst), t.total, f);
        };
        using gradsync::detail::type_tag;
        if (t.dtype == DType::float32 && wire == DType::float16)
            launch(type_tag<float>{}, type_tag<float16>{});
        else if (t.dtype == DType::float32 && wire == DType::bfloat16)
            launch(type_tag<float>{}, type_tag<bfloat16>{});
        else if (t.dtype == DType::float16 && wire == DType::float32)
            launch(type_tag<float16>{}, type_tag<float>{});
        else if (t.dtype == DType::bfloat16 && wire == DType::float32)
            launch(type_tag<bfloat16>{}, type_tag<float>{});
        else
            throw Error("gradsync: CudaMemory: no conversion of " + to_string(t.dtype) + " gradients to " +
                        to_string(wire));
        GRADSYNC_CUDA_CHECK(cudaGetLastError());
    }

    void prepare_results(std::size_t slots) {
        gradsync::detail::DeviceScope scope(device_);
        state_->results = cuda::DeviceBytes((slots + 1) * sizeof(double));  // the last: for scale()
        state_->host.assign(slots, 0.0);
        GRADSYNC_CUDA_CHECK(cudaMemsetAsync(state_->results.data(), 0, state_->results.size(), stream_));
    }

    // One launch: the tensors = `src` (the reduced bucket; null: the tensors themselves) times
    // `factor`, and the sum of the squares written into result slot `slot` on the device. A
    // float16 wire (float32 gradients) is first checked for an infinity or NaN, on the device: if
    // it holds one, nothing is written and the slot's result is NaN. A float32 source for 16-bit
    // gradients (a hook's copy) is rounded once.
    void finalize(const Table& t, const std::byte* src, DType src_type, double factor, std::size_t slot) {
        gradsync::detail::DeviceScope scope(device_);
        if (src == nullptr || src_type == t.dtype)
            return launch_finalize(t, src, factor, src != nullptr || factor != 1.0, result(slot));
        if (src_type == DType::float32 && (t.dtype == DType::float16 || t.dtype == DType::bfloat16)) {
            const auto* from = reinterpret_cast<const float*>(src);
            if (t.dtype == DType::float16)
                launch_kernel<float, float16>(t, from, factor, true, nullptr, result(slot));
            else
                launch_kernel<float, bfloat16>(t, from, factor, true, nullptr, result(slot));
            return;
        }
        if (t.dtype != DType::float32 || (src_type != DType::float16 && src_type != DType::bfloat16))
            throw Error("gradsync: CudaMemory: a " + to_string(src_type) + " wire for " + to_string(t.dtype) +
                        " gradients");
        const unsigned* skip = nullptr;
        if (src_type == DType::float16) {
            unsigned* flag = state_->flag();
            GRADSYNC_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(unsigned), stream_));
            const std::uint64_t wanted = (t.total + 255) / 256;
            const unsigned blocks = wanted == 0 ? 1u : wanted < 1024 ? unsigned(wanted) : 1024u;
            auto* kernel = &cuda::detail::nonfinite_float16_kernel<void>;
            kernel<<<blocks, 256, 0, stream_>>>(reinterpret_cast<const float16*>(src), t.total, flag);
            GRADSYNC_CUDA_CHECK(cudaGetLastError());
            skip = flag;
        }
        const auto launch = [&](auto wire) {
            using W = decltype(wire);
            launch_kernel<W, float>(t, reinterpret_cast<const W*>(src), factor, true, skip, result(slot));
        };
        if (src_type == DType::float16)
            launch(float16{});
        else
            launch(bfloat16{});
    }

    // Reads every result slot back: waits for the stream (the step's one host synchronization).
    std::span<const double> results() {
        gradsync::detail::DeviceScope scope(device_);
        auto& s = *state_;
        if (!s.host.empty()) {
            GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(s.host.data(), s.results.data(), s.host.size() * sizeof(double),
                                                cudaMemcpyDeviceToHost, stream_));
            GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream_));
        }
        return s.host;
    }

    // Every slot combined, in slot order, in device memory: no host synchronization.
    const StepVerdict* verdict() {
        gradsync::detail::DeviceScope scope(device_);
        auto* out = reinterpret_cast<StepVerdict*>(state_->verdict.data());
        auto* kernel = &cuda::detail::verdict_kernel<void>;
        kernel<<<1, 1, 0, stream_>>>(result(0), state_->host.size(), out);
        GRADSYNC_CUDA_CHECK(cudaGetLastError());
        return out;
    }

    std::vector<double> segment_sums(const Table& t) const {
        gradsync::detail::DeviceScope scope(device_);
        std::vector<double> out(t.host.size());
        if (out.empty()) return out;
        cuda::DeviceBytes sums(out.size() * sizeof(double));
        gradsync::detail::visit_float_dtype(t.dtype, [&]<class T>(gradsync::detail::type_tag<T>) {
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
        gradsync::detail::DeviceScope scope(device_);
        launch_finalize(t, nullptr, factor, true, result(state_->host.size()));
    }

    void zero(Segment s, DType t) const {
        gradsync::detail::DeviceScope scope(device_);
        GRADSYNC_CUDA_CHECK(cudaMemsetAsync(s.data, 0, s.count * size_of(t), stream_));
    }

    // Copies between device memory and the host, for checkpoints: after the work queued on the
    // stream, and done when they return (the host waits for the stream).
    void to_host(std::span<std::byte> host, const std::byte* from) const {
        if (host.empty()) return;
        gradsync::detail::DeviceScope scope(device_);
        GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(host.data(), from, host.size(), cudaMemcpyDeviceToHost, stream_));
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    void from_host(std::byte* to, std::span<const std::byte> host) const {
        if (host.empty()) return;
        gradsync::detail::DeviceScope scope(device_);
        GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(to, host.data(), host.size(), cudaMemcpyHostToDevice, stream_));
        GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }

private:
    struct State {
        cuda::FinalizeScratch scratch;
        cuda::DeviceBytes results;  // double per slot, on the device
        std::vector<double> host;   // the slots as last read back
        cuda::DeviceBytes flags = cuda::DeviceBytes(sizeof(unsigned));
        cuda::DeviceBytes verdict = cuda::DeviceBytes(sizeof(StepVerdict));

        [[nodiscard]] unsigned* flag() const { return reinterpret_cast<unsigned*>(flags.data()); }
    };

    [[nodiscard]] double* result(std::size_t slot) const {
        return reinterpret_cast<double*>(state_->results.data()) + slot;
    }

    void launch_finalize(const Table& t, const std::byte* src, double factor, bool write, double* sum) const {
        gradsync::detail::visit_float_dtype(t.dtype, [&]<class T>(gradsync::detail::type_tag<T>) {
            launch_kernel<T, T>(t, reinterpret_cast<const T*>(src), factor, write, nullptr, sum);
        });
    }

    template <class S, class T>
    void launch_kernel(const Table& t, const S* src, double factor, bool write, const unsigned* skip,
                       double* sum) const {
        const std::uint64_t tiles = (t.total + cuda::pack_tile - 1) / cuda::pack_tile;
        const unsigned blocks = tiles == 0                      ? 1u
                                : tiles < cuda::finalize_blocks ? unsigned(tiles)
                                                                : cuda::finalize_blocks;
        auto& scratch = state_->scratch;
        cuda::detail::table_finalize_kernel<S, T><<<blocks, cuda::finalize_threads, 0, stream_>>>(
            t.entries().data(), t.host.size(), src, t.total, static_cast<cuda::detail::device_accumulator_t<T>>(factor),
            write, skip, scratch.block_sums(), scratch.ticket(), sum);
        GRADSYNC_CUDA_CHECK(cudaGetLastError());
    }

    template <bool to_bucket>
    void copy(const Table& t, std::byte* bucket) const {
        gradsync::detail::DeviceScope scope(device_);
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
    int device_ = 0;
    std::shared_ptr<State> state_;
};

}  // namespace gradsync::inline v0
