// The stand-in CUDA runtime's C functions for devices, memory, streams and events, declared by the
// CUDA toolkit's own <cuda_runtime.h> (so a program compiles against the real header and links
// against these). Kernels: kernel_launch.cpp.
#include "device_state.hpp"

#include <cstdlib>
#include <cstring>
#include <new>  // for std::align_val_t
#include <string>
#include <vector>

using standin::detail::Allocation;
using standin::detail::MemoryKind;
using standin::detail::report_misuse;
using standin::detail::this_thread;

namespace {

cudaError_t fail(cudaError_t code) {
    this_thread().last = code;
    return code;
}

cudaError_t misuse(cudaError_t code, std::string what) {
    report_misuse(std::move(what));
    return fail(code);
}

constexpr std::size_t alignment = 256;

void* allocate(std::size_t bytes, MemoryKind kind, int device) {
    const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
    void* p = ::operator new (rounded, std::align_val_t{alignment});
    // Fresh device memory holds no zeros: all ones (a NaN in every float type) finds a read of it.
    if (kind == MemoryKind::device) std::memset(p, 0xff, rounded);
    standin::detail::add_allocation(Allocation{reinterpret_cast<std::uintptr_t>(p), bytes, kind, device});
    return p;
}

void release(void* p) { ::operator delete (p, std::align_val_t{alignment}); }

// Where a copy's end lies: device memory, pinned host memory, or pageable host memory.
enum class Side { device, pinned, pageable };
Side side_of(const void* p) {
    const auto a = standin::detail::find_allocation(p);
    if (!a) return Side::pageable;
    return a->kind == MemoryKind::device ? Side::device : Side::pinned;
}

bool kind_matches(cudaMemcpyKind kind, Side dst, Side src) {
    const bool dst_dev = dst == Side::device, src_dev = src == Side::device;
    switch (kind) {
        case cudaMemcpyHostToDevice: return dst_dev && !src_dev;
        case cudaMemcpyDeviceToHost: return !dst_dev && src_dev;
        case cudaMemcpyDeviceToDevice: return dst_dev && src_dev;
        case cudaMemcpyHostToHost: return !dst_dev && !src_dev;
        default: return true;
    }
}

void wait_for_stream(const CUstream_st& s) { s.queue->wait_done(s.queue->last_ticket()); }

// A copy queued on `stream`. From pageable host memory the source is read at once (the runtime
// stages it), and the bytes land when the stream reaches the copy; into pageable memory the host
// waits for the copy, as CUDA does.
cudaError_t copy_on(CUstream_st& stream, void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                    const char* call, bool wait) {
    const Side d = side_of(dst), s = side_of(src);
    if (!kind_matches(kind, d, s))
        return misuse(
            cudaErrorInvalidValue,
            std::string(call) + ": the pointers' memory does not match the copy's kind " + std::to_string(int(kind)));
    if (bytes == 0) return cudaSuccess;
    if (s == Side::pageable && d != Side::pageable) {
        auto staged = std::make_shared<std::vector<std::byte>>(static_cast<const std::byte*>(src),
                                                               static_cast<const std::byte*>(src) + bytes);
        standin::detail::enqueue(stream, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
    } else {
        standin::detail::enqueue(stream, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
    }
    if (wait || (d == Side::pageable && s == Side::device)) {
        standin::detail::count_wait();
        wait_for_stream(stream);
    }
    return cudaSuccess;
}

}  // namespace

// Devices.

cudaError_t cudaGetDeviceCount(int* count) {
    *count = standin::detail::device_count().load();
    return *count == 0 ? fail(cudaErrorNoDevice) : cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= standin::detail::device_count().load() || device >= standin::detail::max_devices)
        return fail(cudaErrorInvalidDevice);
    auto& t = this_thread();
    if (!t.context || t.device != device) standin::detail::note_context(device);
    t.device = device;
    t.chosen = true;
    t.context = true;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
    *device = this_thread().device;
    return cudaSuccess;
}

cudaError_t cudaGetLastError() {
    auto& t = this_thread();
    const cudaError_t code = t.last;
    t.last = cudaSuccess;
    return code;
}

cudaError_t cudaPeekAtLastError() { return this_thread().last; }

const char* cudaGetErrorName(cudaError_t code) {
    switch (code) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
        case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
        case cudaErrorNoDevice: return "cudaErrorNoDevice";
        case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
        case cudaErrorNotReady: return "cudaErrorNotReady";
        case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
        case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
        default: return "cudaErrorUnknown";
    }
}

const char* cudaGetErrorString(cudaError_t code) {
    switch (code) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorInvalidDevice: return "invalid device ordinal";
        case cudaErrorNoDevice: return "no CUDA-capable device is detected";
        case cudaErrorInvalidResourceHandle: return "invalid resource handle";
        case cudaErrorNotReady: return "device not ready";
        case cudaErrorInvalidDeviceFunction: return "invalid device function";
        case cudaErrorLaunchFailure: return "unspecified launch failure";
        default: return "unknown error";
    }
}

cudaError_t cudaDeviceSynchronize() {
    const int device = standin::detail::device_for_call("cudaDeviceSynchronize");
    standin::detail::count_wait();
    for (const auto& s : standin::detail::streams_of(device)) wait_for_stream(*s);
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
    if (device < 0 || device >= standin::detail::device_count().load()) return fail(cudaErrorInvalidDevice);
    *prop = cudaDeviceProp{};
    std::strncpy(prop->name, "gradsync stand-in device", sizeof prop->name - 1);
    prop->totalGlobalMem = std::size_t(1) << 30;
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = 4;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(std::size_t* free, std::size_t* total) {
    (void)standin::detail::device_for_call("cudaMemGetInfo");
    *free = *total = std::size_t(1) << 30;  // 1 GiB: tests that need more skip
    return cudaSuccess;
}

// Memory.

cudaError_t cudaMalloc(void** p, std::size_t bytes) {
    const int device = standin::detail::device_for_call("cudaMalloc");
    *p = bytes == 0 ? nullptr : allocate(bytes, MemoryKind::device, device);
    return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
    const int device = standin::detail::device_for_call("cudaFree");
    if (p == nullptr) return cudaSuccess;
    const auto a = standin::detail::find_allocation(p);
    if (!a || a->begin != reinterpret_cast<std::uintptr_t>(p) || a->kind != MemoryKind::device)
        return misuse(cudaErrorInvalidValue, "cudaFree of memory cudaMalloc did not return");
    // cudaFree waits for the device, so that nothing queued still uses the memory.
    standin::detail::count_wait();
    for (const auto& s : standin::detail::streams_of(device)) wait_for_stream(*s);
    standin::detail::remove_allocation(p);
    release(p);
    return cudaSuccess;
}

// Stream-ordered: the memory may be used by work queued after the allocation, and is freed when
// the stream reaches the free.
cudaError_t cudaMallocAsync(void** p, std::size_t bytes, cudaStream_t stream) {
    const int device = standin::detail::device_for_call("cudaMallocAsync");
    auto s = standin::detail::resolve_stream(stream);
    if (!s) return misuse(cudaErrorInvalidResourceHandle, "cudaMallocAsync on a stream the runtime does not know");
    if (s->device != device)
        return misuse(cudaErrorInvalidValue, "cudaMallocAsync on a stream of device " + std::to_string(s->device) +
                                                 " from a thread whose current device is " + std::to_string(device));
    *p = bytes == 0 ? nullptr : allocate(bytes, MemoryKind::device, device);
    return cudaSuccess;
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
    (void)standin::detail::device_for_call("cudaFreeAsync");
    if (p == nullptr) return cudaSuccess;
    auto s = standin::detail::resolve_stream(stream);
    if (!s) return misuse(cudaErrorInvalidResourceHandle, "cudaFreeAsync on a stream the runtime does not know");
    const auto a = standin::detail::find_allocation(p);
    if (!a || a->begin != reinterpret_cast<std::uintptr_t>(p) || a->kind != MemoryKind::device)
        return misuse(cudaErrorInvalidValue, "cudaFreeAsync of memory cudaMalloc did not return");
    standin::detail::enqueue(*s, [p] {
        standin::detail::remove_allocation(p);
        release(p);
    });
    return cudaSuccess;
}

cudaError_t cudaStreamGetDevice(cudaStream_t stream, int* device) {
    auto s = standin::detail::resolve_stream(stream);
    if (!s) return misuse(cudaErrorInvalidResourceHandle, "cudaStreamGetDevice of a stream the runtime does not know");
    *device = s->device;
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, std::size_t bytes) {
    const int device = standin::detail::device_for_call("cudaMallocHost");
    *p = allocate(bytes == 0 ? 1 : bytes, MemoryKind::pinned, device);
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** p, std::size_t bytes, unsigned int) { return cudaMallocHost(p, bytes); }

cudaError_t cudaFreeHost(void* p) {
    if (p == nullptr) return cudaSuccess;
    const auto a = standin::detail::remove_allocation(p);
    if (!a || a->kind != MemoryKind::pinned)
        return misuse(cudaErrorInvalidValue, "cudaFreeHost of memory cudaMallocHost did not return");
    release(p);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* p) {
    *attributes = cudaPointerAttributes{};
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = -2;
    if (const auto a = standin::detail::find_allocation(p)) {
        attributes->device = a->device;
        if (a->kind == MemoryKind::device) {
            attributes->type = cudaMemoryTypeDevice;
            attributes->devicePointer = const_cast<void*>(p);
        } else {
            attributes->type = cudaMemoryTypeHost;
            attributes->hostPointer = const_cast<void*>(p);
            attributes->devicePointer = const_cast<void*>(p);
        }
    }
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    (void)standin::detail::device_for_call("cudaMemcpy");
    auto legacy = standin::detail::resolve_stream(nullptr);
    const Side d = side_of(dst), s = side_of(src);
    // From pageable memory the copy returns once the bytes are staged, after the default stream's
    // earlier work: they land on the device later, as the DMA does. Other copies wait.
    if (s == Side::pageable && d == Side::device) {
        standin::detail::count_wait();
        wait_for_stream(*legacy);
        return copy_on(*legacy, dst, src, bytes, kind, "cudaMemcpy", false);
    }
    if (d == Side::device && s == Side::device) return copy_on(*legacy, dst, src, bytes, kind, "cudaMemcpy", false);
    return copy_on(*legacy, dst, src, bytes, kind, "cudaMemcpy", true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    (void)standin::detail::device_for_call("cudaMemcpyAsync");
    auto s = standin::detail::resolve_stream(stream);
    if (!s) return misuse(cudaErrorInvalidResourceHandle, "cudaMemcpyAsync on a stream the runtime does not know");
    return copy_on(*s, dst, src, bytes, kind, "cudaMemcpyAsync", false);
}

namespace {
cudaError_t memset_on(CUstream_st& stream, void* p, int value, std::size_t bytes, const char* call) {
    const auto a = standin::detail::find_allocation(p);
    if (bytes != 0 &&
        (!a || a->kind != MemoryKind::device || reinterpret_cast<std::uintptr_t>(p) + bytes > a->begin + a->size))
        return misuse(cudaErrorInvalidValue,
                      std::string(call) + " of memory that is not device memory (or past its end)");
    standin::detail::enqueue(stream, [p, value, bytes] { std::memset(p, value, bytes); });
    return cudaSuccess;
}
}  // namespace

cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t stream) {
    (void)standin::detail::device_for_call("cudaMemsetAsync");
    auto s = standin::detail::resolve_stream(stream);
    if (!s) return misuse(cudaErrorInvalidResourceHandle, "cudaMemsetAsync on a stream the runtime does not know");
    return memset_on(*s, p, value, bytes, "cudaMemsetAsync");
}

cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
    (void)standin::detail::device_for_call("cudaMemset");
    auto legacy = standin::detail::resolve_stream(nullptr);
    const cudaError_t code = memset_on(*legacy, p, value, bytes, "cudaMemset");
    standin::detail::count_wait();
    wait_for_stream(*legacy);
    return code;
}

// Streams.

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
    auto s = std::make_shared<CUstream_st>();
    s->device = standin::detail::device_for_call("cudaStreamCreate");
    s->blocking = (flags & cudaStreamNonBlocking) == 0;
    s->queue = standin::detail::WorkQueue::start();
    *stream = s.get();
    standin::detail::add_stream(std::move(s));
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    auto s = standin::detail::remove_stream(stream);
    if (!s) return misuse(cudaErrorInvalidResourceHandle, "cudaStreamDestroy of a stream the runtime does not know");
    s->queue->close();  // its queued work still runs
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    (void)standin::detail::device_for_call("cudaStreamSynchronize");
    auto s = standin::detail::resolve_stream(stream);
    if (!s)
        return misuse(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize of a stream the runtime does not know");
    standin::detail::count_wait();
    wait_for_stream(*s);
    return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    auto s = standin::detail::resolve_stream(stream);
    if (!s) return misuse(cudaErrorInvalidResourceHandle, "cudaStreamQuery of a stream the runtime does not know");
    return s->queue->done(s->queue->last_ticket()) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
    (void)standin::detail::device_for_call("cudaStreamWaitEvent");
    auto s = standin::detail::resolve_stream(stream);
    auto e = standin::detail::find_event(event);
    if (!s || !e)
        return misuse(cudaErrorInvalidResourceHandle,
                      "cudaStreamWaitEvent with a stream or event the runtime does not know");
    std::uint64_t target = 0;
    {
        std::lock_guard lock(e->mutex);
        target = e->recorded;
    }
    // CUDA lets a wait for an event never recorded pass at once: an ordering that is not there.
    if (target == 0) {
        report_misuse("cudaStreamWaitEvent on an event never recorded: the stream waits for nothing");
        return cudaSuccess;
    }
    standin::detail::enqueue(*s, [e, target] {
        std::unique_lock lock(e->mutex);
        e->changed.wait(lock, [&] { return e->completed >= target; });
    });
    return cudaSuccess;
}

// Events.

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
    auto e = std::make_shared<CUevent_st>();
    e->device = standin::detail::device_for_call("cudaEventCreate");
    *event = e.get();
    standin::detail::add_event(std::move(e));
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    if (!standin::detail::remove_event(event))
        return misuse(cudaErrorInvalidResourceHandle, "cudaEventDestroy of an event the runtime does not know");
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    const int device = standin::detail::device_for_call("cudaEventRecord");
    auto s = standin::detail::resolve_stream(stream);
    auto e = standin::detail::find_event(event);
    if (!s || !e)
        return misuse(cudaErrorInvalidResourceHandle,
                      "cudaEventRecord with a stream or event the runtime does not know");
    if (s->device != e->device || s->device != device)
        return misuse(cudaErrorInvalidResourceHandle, "cudaEventRecord: event of device " + std::to_string(e->device) +
                                                          ", stream of device " + std::to_string(s->device) +
                                                          ", current device " + std::to_string(device));
    std::uint64_t generation = 0;
    {
        std::lock_guard lock(e->mutex);
        generation = ++e->recorded;
    }
    standin::detail::enqueue(*s, [e, generation] {
        std::lock_guard lock(e->mutex);
        if (generation > e->completed) {
            e->completed = generation;
            e->at = std::chrono::steady_clock::now();
        }
        e->changed.notify_all();
    });
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    auto e = standin::detail::find_event(event);
    if (!e) return misuse(cudaErrorInvalidResourceHandle, "cudaEventQuery of an event the runtime does not know");
    std::lock_guard lock(e->mutex);
    return e->completed >= e->recorded ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    auto e = standin::detail::find_event(event);
    if (!e) return misuse(cudaErrorInvalidResourceHandle, "cudaEventSynchronize of an event the runtime does not know");
    standin::detail::count_wait();
    std::unique_lock lock(e->mutex);
    const std::uint64_t target = e->recorded;
    e->changed.wait(lock, [&] { return e->completed >= target; });
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    auto a = standin::detail::find_event(start);
    auto b = standin::detail::find_event(end);
    if (!a || !b)
        return misuse(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime of an event the runtime does not know");
    std::chrono::steady_clock::time_point ta, tb;
    {
        std::lock_guard lock(a->mutex);
        if (a->completed < a->recorded || a->recorded == 0) return fail(cudaErrorNotReady);
        ta = a->at;
    }
    {
        std::lock_guard lock(b->mutex);
        if (b->completed < b->recorded || b->recorded == 0) return fail(cudaErrorNotReady);
        tb = b->at;
    }
    *ms = std::chrono::duration<float, std::milli>(tb - ta).count();
    return cudaSuccess;
}
