// The stand-in CUDA runtime's state, shared by its C functions (cuda_runtime.cpp) and the stand-in
// NCCL (nccl.cpp): device memory as tagged host memory, streams and events, each thread's current
// device, and the misuse log.
#pragma once

#include "work_queue.hpp"

#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

// The runtime's opaque handle types, completed here: a handle is the address of one of these.
struct CUstream_st {
    int device = 0;
    bool legacy = false;    // the device's default stream (0, cudaStreamLegacy)
    bool blocking = false;  // waits for the default stream, and it for this one
    std::shared_ptr<standin::detail::WorkQueue> queue;
};

struct CUevent_st {
    int device = 0;
    std::mutex mutex;
    std::condition_variable changed;
    std::uint64_t recorded = 0;   // records asked for
    std::uint64_t completed = 0;  // records the stream has reached
    std::chrono::steady_clock::time_point at{};
};

namespace standin::detail {

inline constexpr int max_devices = 8;

enum class MemoryKind { device, pinned };

struct Allocation {
    std::uintptr_t begin = 0;
    std::size_t size = 0;
    MemoryKind kind = MemoryKind::device;
    int device = 0;
};

// What one thread has told the runtime, and what it has done.
struct ThreadState {
    int device = 0;
    bool chosen = false;   // called cudaSetDevice
    bool context = false;  // has a current context (chosen, or used device 0 without choosing)
    cudaError_t last = cudaSuccess;
    std::uint64_t waits = 0;
};
ThreadState& this_thread();

void report_misuse(std::string what);

// Devices the runtime reports.
std::atomic<int>& device_count();

// Device memory and pinned host memory, by address range.
void add_allocation(const Allocation& a);
std::optional<Allocation> remove_allocation(const void* p);  // by its first byte
std::optional<Allocation> find_allocation(const void* p);    // any byte of it

// The handles this runtime gave out; null for one it did not (or has destroyed).
void add_stream(std::shared_ptr<CUstream_st> s);
std::shared_ptr<CUstream_st> remove_stream(cudaStream_t s);
std::shared_ptr<CUstream_st> find_stream(cudaStream_t s);
void add_event(std::shared_ptr<CUevent_st> e);
std::shared_ptr<CUevent_st> remove_event(cudaEvent_t e);
std::shared_ptr<CUevent_st> find_event(cudaEvent_t e);
// The device's default stream and every stream made on it.
std::vector<std::shared_ptr<CUstream_st>> streams_of(int device);

// The stream `s` names for the calling thread (0 and cudaStreamLegacy: the current device's
// default stream); null for a handle the runtime does not know.
std::shared_ptr<CUstream_st> resolve_stream(cudaStream_t s);

// Queues `task` on `stream`, after what the default stream was given where the two synchronize.
void enqueue(CUstream_st& stream, std::function<void()> task);

// The calling thread's device, for a call that needs one: makes a context there, and reports a
// thread that never chose its device.
int device_for_call(const char* call);
void note_context(int device);  // a thread's current context became `device`'s

// Counts a host wait of the calling thread.
inline void count_wait() { ++this_thread().waits; }

}  // namespace standin::detail
