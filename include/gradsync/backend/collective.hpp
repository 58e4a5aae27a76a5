// One collective as every part of gradsync describes it (each backend's errors, the NCCL
// watchdog, a rendezvous of CUDA ranks, DataParallel's diagnosis): its kind, its number on this
// rank, its size and type, and the tag that says what it is for.
//
//   allreduce #7 of 300 x float32 (1.2 KiB), average (step 1, bucket 1)
//   reduce_scatter #8 of 300 x float32 (1.2 KiB), sum
//   broadcast #2 of 1.5 KiB from rank 0
//   barrier #4
#pragma once

#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace gradsync::inline v0 {

enum class CollectiveKind : std::uint8_t { allreduce, broadcast, barrier, reduce_scatter, all_gather };

inline std::string to_string(CollectiveKind k) {
    switch (k) {
        case CollectiveKind::allreduce: return "allreduce";
        case CollectiveKind::broadcast: return "broadcast";
        case CollectiveKind::barrier: return "barrier";
        case CollectiveKind::reduce_scatter: return "reduce_scatter";
        case CollectiveKind::all_gather: return "all_gather";
    }
    return "collective";
}

struct CollectiveCall {
    CollectiveKind kind = CollectiveKind::barrier;
    std::uint64_t seq = 0;         // 1 for the rank's first collective; 0: not numbered
    std::size_t count = 0;         // elements of `dtype`, or bytes when there is none
    std::optional<DType> dtype{};  // none: raw bytes (a broadcast)
    ReduceOp op = ReduceOp::sum;
    int root = 0;  // a broadcast's
    CollectiveTag tag{};

    [[nodiscard]] Bytes bytes() const { return Bytes{count * (dtype ? size_of(*dtype) : 1)}; }

    [[nodiscard]] std::string describe() const {
        std::string out = to_string(kind);
        if (seq != 0) out += " #" + std::to_string(seq);
        if (kind != CollectiveKind::barrier) {
            out += " of ";
            if (dtype)
                out += std::to_string(count) + " x " + to_string(*dtype) + " (" + to_string(bytes()) + ")";
            else
                out += to_string(bytes());
        }
        if (kind == CollectiveKind::allreduce || kind == CollectiveKind::reduce_scatter) out += ", " + to_string(op);
        if (kind == CollectiveKind::broadcast) out += " from rank " + std::to_string(root);
        if (tag.step >= 0) {
            out += " (step " + std::to_string(tag.step);
            if (tag.bucket >= 0) out += ", bucket " + std::to_string(tag.bucket);
            out += ")";
        }
        return out;
    }

    // The same collective on two ranks: every field alike.
    [[nodiscard]] bool same_as(const CollectiveCall& o) const {
        return kind == o.kind && seq == o.seq && count == o.count && dtype == o.dtype && op == o.op && root == o.root &&
               tag == o.tag;
    }
};

// What every backend that compares its ranks' calls says when rank `rank` is not in rank 0's
// `reference` (the two not same_as each other).
inline std::string mismatch_message(const CollectiveCall& reference, int rank, const CollectiveCall& theirs) {
    // Alike but for the tag's fingerprint: the same call of another history.
    const bool same_call = reference.describe() == theirs.describe();
    return "collective mismatch: rank 0 is in " + reference.describe() + " but rank " + std::to_string(rank) +
           " is in " + theirs.describe() +
           (same_call ? " of another history (another DataParallel on this backend, or after collectives that "
                        "differed earlier)"
                      : std::string()) +
           "; every rank must call the same collectives in the same order with the same sizes";
}

}  // namespace gradsync::inline v0
