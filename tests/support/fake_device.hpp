// Stand-ins for a device backend and device memory on the host, for tests of the control flow
// the GPU path takes: a LocalBackend that says its collectives take device memory (as NcclBackend
// and CudaLocalBackend do), and HostMemory that says it is device memory (as CudaMemory is).
#pragma once

#include <gradsync/backend/local.hpp>
#include <gradsync/memory/host.hpp>

#include <span>
#include <string>

namespace testing_support {

using gradsync::LocalBackend;

// LocalBackend's collectives, declared to take device memory. wait_on_device(h) is where a
// device backend makes the trainer's stream wait; here the host waits, and the test counts it.
class FakeDeviceBackend {
public:
    static constexpr bool device_memory = true;
    static constexpr bool checks_tags = true;

    explicit FakeDeviceBackend(LocalBackend& b) : b_(b) {}
    [[nodiscard]] int rank() const { return b_.rank(); }
    [[nodiscard]] int size() const { return b_.size(); }
    [[nodiscard]] bool supports(gradsync::DType t) const { return b_.supports(t); }
    gradsync::CollectiveHandle allreduce_async(gradsync::Buffer buf, gradsync::ReduceOp op,
                                               gradsync::CollectiveTag tag = {}) {
        return b_.allreduce_async(buf, op, tag);
    }
    void allreduce(gradsync::Buffer buf, gradsync::ReduceOp op, gradsync::CollectiveTag tag = {}) {
        b_.allreduce(buf, op, tag);
    }
    // The sharding collectives over packed buffers, as NcclBackend has them.
    gradsync::CollectiveHandle reduce_scatter_async(gradsync::Buffer buf, gradsync::ReduceOp op,
                                                    gradsync::CollectiveTag tag = {}) {
        return b_.reduce_scatter_async(buf, op, tag);
    }
    void reduce_scatter(gradsync::Buffer buf, gradsync::ReduceOp op, gradsync::CollectiveTag tag = {}) {
        b_.reduce_scatter(buf, op, tag);
    }
    gradsync::CollectiveHandle all_gather_async(gradsync::Buffer buf, gradsync::CollectiveTag tag = {}) {
        return b_.all_gather_async(buf, tag);
    }
    void all_gather(gradsync::Buffer buf, gradsync::CollectiveTag tag = {}) { b_.all_gather(buf, tag); }
    void broadcast(std::span<std::byte> bytes, int root, gradsync::CollectiveTag tag = {}) {
        b_.broadcast(bytes, root, tag);
    }
    void barrier() { b_.barrier(); }
    void abort(const std::string& reason) { b_.abort(reason); }
    // The stream collectives are ordered after (a device backend's compute stream).
    [[nodiscard]] const void* compute_stream() const { return stream; }

    void wait_on_device(const gradsync::CollectiveHandle& h) {
        ++device_waits;
        h.wait();
    }
    void throw_if_failed() const {
        ++health_checks;
        if (!failure.empty()) throw gradsync::CollectiveError(failure);
    }

    int device_waits = 0;
    mutable int health_checks = 0;
    std::string failure;           // what throw_if_failed reports, when set
    const void* stream = nullptr;  // what compute_stream() says

private:
    LocalBackend& b_;
};

// HostMemory's passes, declared to be device memory, as CudaMemory is, with the stream its
// passes would be queued on.
struct FakeDeviceMemory : gradsync::HostMemory {
    static constexpr bool on_device = true;
    FakeDeviceMemory() = default;
    explicit FakeDeviceMemory(const void* stream) : on_stream(stream) {}
    [[nodiscard]] const void* stream() const { return on_stream; }
    const void* on_stream = nullptr;
};

}  // namespace testing_support
