// What one collective of the stand-in NCCL computes, once every rank has issued it: sums in rank
// order in the accumulator type (float for the 16-bit types), so that a result is bitwise what
// LocalBackend and CudaLocalBackend give; ncclAvg of floating types is NCCL's pre-multiplied sum by
// 1/ranks. Every result is computed before any buffer is written, so buffers may alias.
#pragma once

#include <gradsync/half.hpp>

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace standin::detail {

enum class NcclKind { allreduce, reduce_scatter, all_gather, broadcast, reduce };

// One rank's part of a collective.
struct NcclPart {
    NcclKind kind = NcclKind::allreduce;
    const void* send = nullptr;
    void* recv = nullptr;
    std::size_t count = 0;  // per rank for reduce_scatter (received) and all_gather (sent)
    ncclDataType_t type = ncclFloat32;
    ncclRedOp_t op = ncclSum;
    std::optional<double> premul;  // a pre-multiplied sum's factor (ncclRedOpCreatePreMulSum)
    int root = 0;

    [[nodiscard]] bool same_as(const NcclPart& o) const {
        return kind == o.kind && count == o.count && type == o.type && root == o.root &&
               (op < ncclNumOps ? op == o.op : o.op >= ncclNumOps);
    }
    [[nodiscard]] std::string describe() const {
        static const char* names[] = {"ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast",
                                      "ncclReduce"};
        return std::string(names[int(kind)]) + " of " + std::to_string(count) + " elements of type " +
               std::to_string(int(type)) + ", op " + std::to_string(int(op)) + ", root " + std::to_string(root);
    }
};

std::size_t nccl_type_size(ncclDataType_t t);

// Runs one collective over every rank's part (in rank order); false for an operation the
// stand-in does not model (then nothing is written).
bool nccl_compute(const std::vector<NcclPart>& parts);

namespace reduce_impl {

template <class T>
struct Accumulator {
    using type = T;
};
template <>
struct Accumulator<gradsync::float16> {
    using type = float;
};
template <>
struct Accumulator<gradsync::bfloat16> {
    using type = float;
};

template <class T>
auto widen(T v) {
    using A = typename Accumulator<T>::type;
    return static_cast<A>(v);
}

template <class T, class A>
T narrow(A v) {
    return static_cast<T>(v);
}

// The reduction of element i over the ranks' `inputs`, at `offset` elements into each.
template <class T>
T reduce_one(const std::vector<const T*>& inputs, std::size_t i, ncclRedOp_t op, std::optional<double> premul) {
    using A = typename Accumulator<T>::type;
    const std::size_t n = inputs.size();
    constexpr bool floating = !std::is_integral_v<T>;
    std::optional<A> factor;
    if (premul) factor = static_cast<A>(*premul);
    if (op == ncclAvg && floating) factor = A(1) / static_cast<A>(n);
    A acc{};
    for (std::size_t r = 0; r < n; ++r) {
        A v = widen(inputs[r][i]);
        if (factor) v = v * *factor;
        if (r == 0) {
            acc = v;
        } else if (op == ncclMax) {
            acc = v > acc ? v : acc;
        } else if (op == ncclMin) {
            acc = v < acc ? v : acc;
        } else if (op == ncclProd) {
            acc = acc * v;
        } else {
            acc = acc + v;
        }
    }
    if (op == ncclAvg && !floating) acc = acc / static_cast<A>(n);
    return narrow<T>(acc);
}

template <class T>
void compute(const std::vector<NcclPart>& parts) {
    const std::size_t n = parts.size();
    const NcclPart& first = parts[0];
    const std::size_t count = first.count;
    std::vector<const T*> inputs;
    for (const auto& p : parts) inputs.push_back(static_cast<const T*>(p.send));
    switch (first.kind) {
        case NcclKind::allreduce:
        case NcclKind::reduce: {
            std::vector<T> out(count);
            for (std::size_t i = 0; i < count; ++i) out[i] = reduce_one<T>(inputs, i, first.op, first.premul);
            for (std::size_t r = 0; r < n; ++r)
                if (first.kind == NcclKind::allreduce || int(r) == first.root)
                    std::memcpy(parts[r].recv, out.data(), count * sizeof(T));
            return;
        }
        case NcclKind::reduce_scatter: {
            std::vector<std::vector<T>> out(n, std::vector<T>(count));
            for (std::size_t r = 0; r < n; ++r)
                for (std::size_t i = 0; i < count; ++i)
                    out[r][i] = reduce_one<T>(inputs, r * count + i, first.op, first.premul);
            for (std::size_t r = 0; r < n; ++r) std::memcpy(parts[r].recv, out[r].data(), count * sizeof(T));
            return;
        }
        case NcclKind::all_gather: {
            std::vector<T> out(n * count);
            for (std::size_t r = 0; r < n; ++r) std::memcpy(out.data() + r * count, inputs[r], count * sizeof(T));
            for (std::size_t r = 0; r < n; ++r) std::memcpy(parts[r].recv, out.data(), out.size() * sizeof(T));
            return;
        }
        case NcclKind::broadcast: {
            std::vector<T> out(inputs[std::size_t(first.root)], inputs[std::size_t(first.root)] + count);
            for (std::size_t r = 0; r < n; ++r) std::memcpy(parts[r].recv, out.data(), count * sizeof(T));
            return;
        }
    }
}

}  // namespace reduce_impl

inline std::size_t nccl_type_size(ncclDataType_t t) {
    switch (t) {
        case ncclInt8:
        case ncclUint8: return 1;
        case ncclFloat16:
        case ncclBfloat16: return 2;
        case ncclInt32:
        case ncclUint32:
        case ncclFloat32: return 4;
        case ncclInt64:
        case ncclUint64:
        case ncclFloat64: return 8;
        default: return 0;
    }
}

inline bool nccl_compute(const std::vector<NcclPart>& parts) {
    const NcclPart& first = parts[0];
    if (first.op != ncclSum && first.op != ncclAvg && first.op != ncclMax && first.op != ncclMin &&
        first.op != ncclProd && !first.premul)
        return false;
    switch (first.type) {
        case ncclInt8: reduce_impl::compute<std::int8_t>(parts); return true;
        case ncclUint8: reduce_impl::compute<std::uint8_t>(parts); return true;
        case ncclInt32: reduce_impl::compute<std::int32_t>(parts); return true;
        case ncclUint32: reduce_impl::compute<std::uint32_t>(parts); return true;
        case ncclInt64: reduce_impl::compute<std::int64_t>(parts); return true;
        case ncclUint64: reduce_impl::compute<std::uint64_t>(parts); return true;
        case ncclFloat16: reduce_impl::compute<gradsync::float16>(parts); return true;
        case ncclBfloat16: reduce_impl::compute<gradsync::bfloat16>(parts); return true;
        case ncclFloat32: reduce_impl::compute<float>(parts); return true;
        case ncclFloat64: reduce_impl::compute<double>(parts); return true;
        default: return false;
    }
}

}  // namespace standin::detail
