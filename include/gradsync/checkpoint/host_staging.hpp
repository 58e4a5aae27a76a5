// What a checkpoint reads and writes of a front whose memory policy keeps its tensors on the
// device (CudaMemory): host copies made through the policy (to_host, from_host). With a policy on
// the host the tensors are read and written where they lie.
#pragma once

#include <gradsync/dtype.hpp>

#include <cstddef>
#include <cstring>  // for std::memcpy
#include <span>
#include <vector>

namespace gradsync::inline v0::detail {

template <class Memory>
class HostStaging {
public:
    explicit HostStaging(const Memory& memory) : memory_(memory) {}

    // `tensors` (each with data, count and dtype) as the host may read them: on the device, each
    // points at a host copy this object keeps.
    template <class Tensor>
    [[nodiscard]] std::vector<Tensor> on_host(std::span<const Tensor> tensors) {
        std::vector<Tensor> out(tensors.begin(), tensors.end());
        if constexpr (Memory::on_device)
            for (auto& t : out) {
                // A moved vector keeps its allocation: earlier copies' addresses stay valid.
                auto& copy = copies_.emplace_back(t.count * size_of(t.dtype));
                memory_.to_host(std::span(copy), static_cast<const std::byte*>(t.data));
                t.data = copy.data();
            }
        return out;
    }

    // Host bytes into a tensor the checkpoint restores.
    void copy_in(void* to, std::span<const std::byte> from) const {
        if constexpr (Memory::on_device)
            memory_.from_host(static_cast<std::byte*>(to), from);
        else if (!from.empty())
            std::memcpy(to, from.data(), from.size());
    }

private:
    const Memory& memory_;
    std::vector<std::vector<std::byte>> copies_;
};

}  // namespace gradsync::inline v0::detail
