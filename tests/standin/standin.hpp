// The test-facing side of the stand-ins for the CUDA runtime and NCCL (tests/standin/*.cpp): a
// program linked against them instead of libcudart and libnccl runs gradsync's device code on the
// CPU. Devices are tags on host memory, streams are worker threads that run their work in order,
// events mark a stream's progress, NCCL's ranks are threads of this process that meet at each
// collective, and a kernel runs as the host reference registered for it (kernels.hpp). What a real
// GPU would punish late or never, the stand-in reports at once as a misuse: host memory handed to
// a collective, a device call from a thread that never chose its device, a stream told to wait
// for an event never recorded. Tests only; never installed.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace standin {

// Devices the stand-in reports (cudaGetDeviceCount); 4 unless set. Zero: as a machine without one.
void set_device_count(int n);

// The misuses reported since the last call (each one a sentence naming the call), emptied.
std::vector<std::string> take_misuses();

// Primary contexts made on `device` so far: by cudaSetDevice, or by a device call from a thread
// that never chose one (which lands on device 0, as on a GPU).
int contexts_made(int device);

// Calls that made this thread wait for the device (stream, event and device synchronization,
// synchronous copies and memsets, cudaFree, copies to or from pageable memory).
std::uint64_t host_waits();

// Every piece of work queued on `stream` from now on starts `delay` late: a slow stream.
void slow_stream(cudaStream_t stream, std::chrono::microseconds delay);

// A host function of a kernel's arguments, run on the stream when the kernel would run there.
// `launch(void** args, dim3 grid, dim3 block)` copies what it needs out of args at once.
using KernelCopy = std::function<std::function<void(dim3 grid, dim3 block)>(void** args)>;
void register_kernel(const void* kernel, std::string name, KernelCopy copy);

// NCCL faults and settings.
// From now on ncclCommGetAsyncError on `comm` reports `error`, and ncclGetLastError says `why`.
void nccl_inject_error(ncclComm_t comm, ncclResult_t error, std::string why);
// Each call on a non-blocking communicator returns ncclInProgress, and its next `polls` reads of
// ncclCommGetAsyncError say ncclInProgress still (as NCCL does while its thread queues the
// call); 1 unless set, 0 for "done at once".
void nccl_set_in_progress_polls(int polls);
// Collectives issued on `comm` so far (every call, grouped ones one each).
std::uint64_t nccl_calls(ncclComm_t comm);
// Parts of `comm`'s rank that its streams have reached and that wait there for a peer's.
int nccl_parts_waiting(ncclComm_t comm);

}  // namespace standin
