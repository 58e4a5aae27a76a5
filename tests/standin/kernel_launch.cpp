// Kernels in the stand-in CUDA runtime: what nvcc's host code calls to register and launch a
// kernel (`kernel<<<grid, block, shared, stream>>>(args)`), answered by running the host reference
// registered for that kernel (standin::register_kernel) on the stream. A kernel with no reference
// is a misuse and fails its launch. Also the one driver entry point gradsync asks for.
#include "device_state.hpp"
#include "standin.hpp"

#include <map>
#include <mutex>
#include <string>
#include <utility>  // for std::move
#include <vector>

using standin::detail::report_misuse;
using standin::detail::this_thread;

// nvcc's host code calls these; the toolkit declares them in crt/host_runtime.h and
// crt/device_functions.h, which a host compiler does not read.
extern "C" {
void** __cudaRegisterFatBinary(void* fatCubin);
void __cudaRegisterFatBinaryEnd(void** handle);
void __cudaUnregisterFatBinary(void** handle);
void __cudaRegisterFunction(void** handle, const char* hostFun, char* deviceFun, const char* deviceName,
                            int thread_limit, uint3* tid, uint3* bid, dim3* bDim, dim3* gDim, int* wSize);
void __cudaRegisterVar(void** handle, char* hostVar, char* deviceAddress, const char* deviceName, int ext,
                       std::size_t size, int constant, int global);
char __cudaInitModule(void** handle);
unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim, std::size_t sharedMem, CUstream_st* stream);
cudaError_t __cudaPopCallConfiguration(dim3* gridDim, dim3* blockDim, std::size_t* sharedMem, void* stream);
cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* function);
cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void** args, std::size_t sharedMem,
                               cudaStream_t stream);
}

namespace {

struct Kernel {
    std::string name;
    standin::KernelCopy copy;
};

// References by the host stub they were registered with, and every stub's device name (from
// nvcc's registration at start-up): a template kernel's stub is local to each translation unit,
// so a launch finds its reference through the device name both stubs share.
struct Kernels {
    std::mutex mutex;
    std::map<const void*, Kernel> by_stub;
    std::map<const void*, std::string> device_names;

    // Under the mutex.
    const Kernel* find(const void* stub) {
        if (const auto it = by_stub.find(stub); it != by_stub.end()) return &it->second;
        const auto name = device_names.find(stub);
        if (name == device_names.end()) return nullptr;
        for (const auto& [registered, kernel] : by_stub) {
            const auto other = device_names.find(registered);
            if (other != device_names.end() && other->second == name->second) {
                by_stub[stub] = kernel;  // found at once next time
                return &by_stub[stub];
            }
        }
        return nullptr;
    }
};
Kernels& kernels() {
    static auto* k = new Kernels;
    return *k;
}

struct LaunchConfig {
    dim3 grid, block;
    std::size_t shared = 0;
    cudaStream_t stream = nullptr;
};
std::vector<LaunchConfig>& configs() {
    thread_local std::vector<LaunchConfig> stack;
    return stack;
}

int fat_binary_handle = 0;

cudaError_t launch(const void* function, dim3 grid, dim3 block, void** args, cudaStream_t stream) {
    const int device = standin::detail::device_for_call("a kernel launch");
    auto s = standin::detail::resolve_stream(stream);
    auto fail = [](cudaError_t code, std::string what) {
        report_misuse(std::move(what));
        this_thread().last = code;
        return code;
    };
    if (!s) return fail(cudaErrorInvalidResourceHandle, "a kernel launched on a stream the runtime does not know");
    standin::KernelCopy copy;
    std::string name;
    {
        auto& k = kernels();
        std::lock_guard lock(k.mutex);
        if (const Kernel* found = k.find(function)) {
            copy = found->copy;
            name = found->name;
        }
    }
    if (!copy) return fail(cudaErrorInvalidDeviceFunction, "a kernel with no host reference was launched");
    if (s->device != device)
        return fail(cudaErrorInvalidResourceHandle,
                    name + " launched on a stream of device " + std::to_string(s->device) +
                        " from a thread whose current device is " + std::to_string(device));
    if (grid.x == 0 || block.x == 0 || block.x * block.y * block.z > 1024)
        return fail(cudaErrorInvalidValue, name + " launched with an empty grid or more than 1024 threads a block");
    auto run = copy(args);  // the arguments are read now, as a launch does
    standin::detail::enqueue(*s, [run = std::move(run), grid, block] { run(grid, block); });
    return cudaSuccess;
}

// cuCtxGetCurrent, as the driver entry point gives it: the thread's context, null where it has none.
int context_of_this_thread(void** context) {
    auto& t = this_thread();
    *context = t.context ? reinterpret_cast<void*>(std::uintptr_t(t.device) + 1) : nullptr;
    return 0;
}

}  // namespace

namespace standin {

void register_kernel(const void* kernel, std::string name, KernelCopy copy) {
    auto& k = kernels();
    std::lock_guard lock(k.mutex);
    k.by_stub[kernel] = Kernel{std::move(name), std::move(copy)};
}

}  // namespace standin

void** __cudaRegisterFatBinary(void*) { return reinterpret_cast<void**>(&fat_binary_handle); }
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
void __cudaRegisterFunction(void**, const char* stub, char*, const char* device_name, int, uint3*, uint3*, dim3*, dim3*,
                            int*) {
    auto& k = kernels();
    std::lock_guard lock(k.mutex);
    k.device_names[stub] = device_name;
}
void __cudaRegisterVar(void**, char*, char*, const char*, int, std::size_t, int, int) {}
char __cudaInitModule(void**) { return 1; }

unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim, std::size_t sharedMem, CUstream_st* stream) {
    configs().push_back(LaunchConfig{gridDim, blockDim, sharedMem, stream});
    return 0;
}

cudaError_t __cudaPopCallConfiguration(dim3* gridDim, dim3* blockDim, std::size_t* sharedMem, void* stream) {
    auto& stack = configs();
    if (stack.empty()) return cudaErrorInvalidValue;
    const LaunchConfig c = stack.back();
    stack.pop_back();
    *gridDim = c.grid;
    *blockDim = c.block;
    *sharedMem = c.shared;
    *static_cast<cudaStream_t*>(stream) = c.stream;
    return cudaSuccess;
}

cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* function) {
    *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(function));
    return cudaSuccess;
}

cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void** args, std::size_t,
                               cudaStream_t stream) {
    return launch(reinterpret_cast<const void*>(kernel), gridDim, blockDim, args, stream);
}

cudaError_t cudaLaunchKernel(const void* function, dim3 gridDim, dim3 blockDim, void** args, std::size_t,
                             cudaStream_t stream) {
    return launch(function, gridDim, blockDim, args, stream);
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** function, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
    const bool known = std::string(symbol) == "cuCtxGetCurrent";
    *function = known ? reinterpret_cast<void*>(&context_of_this_thread) : nullptr;
    if (status != nullptr) *status = known ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
    return cudaSuccess;
}
