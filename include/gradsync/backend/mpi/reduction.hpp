// MpiReduction: how MpiBackend reduces a list of segments in place over one communicator. Large
// segments go in pieces of MpiOptions::chunk, through our ring or MPI's own allreduce; small ones
// are packed together first, so that many small tensors never mean many collectives. Also the
// ring's two halves on their own: reduce_scatter and all_gather.
#pragma once

#include <gradsync/backend/collective.hpp>
#include <gradsync/backend/mpi/arithmetic.hpp>
#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/backend/mpi/options.hpp>
#include <gradsync/backend/mpi/scattered_range.hpp>
#include <gradsync/buffer.hpp>  // for shard_of
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

#include <algorithm>  // for std::min, std::max
#include <cstddef>
#include <cstring>  // for std::memcpy
#include <span>
#include <string>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0::detail {

// Owns the MPI datatypes and operations of the 16-bit types and the persistent scratch memory.
// Used by one collective at a time (MpiBackend runs them in order).
class MpiReduction {
public:
    MpiReduction(MPI_Comm comm, const MpiOptions& options, std::string who)
        : comm_(comm), options_(options), who_(std::move(who)) {
        MPI_Comm_rank(comm_, &rank_);
        MPI_Comm_size(comm_, &size_);
        MPI_Type_contiguous(2, MPI_BYTE, &half_type_);
        MPI_Type_commit(&half_type_);
        MPI_Op_create(&mpi_sum_16<float16>, /*commute=*/1, &sum_f16_);
        MPI_Op_create(&mpi_sum_16<bfloat16>, /*commute=*/1, &sum_bf16_);
    }
    MpiReduction(const MpiReduction&) = delete;
    MpiReduction& operator=(const MpiReduction&) = delete;
    ~MpiReduction() {
        MPI_Op_free(&sum_f16_);
        MPI_Op_free(&sum_bf16_);
        MPI_Type_free(&half_type_);
    }

    // Reduces the segments where they lie. Every rank passes segments of the same sizes in the
    // same order.
    void reduce(std::span<const Segment> segments, DType t, ReduceOp op) {
        if (size_ == 1) return;  // the sum and the average of one rank are its own values
        const std::size_t elem = size_of(t);
        const std::size_t small = options_.pack_below.count() / elem;
        auto is_small = [&](const Segment& s) { return s.count != 0 && s.count < small; };
        std::size_t pending = 0;  // elements of the small segments [first_small, ...) not yet reduced
        std::size_t first_small = 0;
        // Reduces the small segments [first_small, end): one where it lies, several packed
        // together in staging_ and copied back.
        auto flush = [&](std::size_t end) {
            if (pending == 0) return;
            std::size_t smalls = 0, last = first_small;
            for (std::size_t i = first_small; i < end; ++i)
                if (is_small(segments[i])) ++smalls, last = i;
            if (smalls == 1) {
                reduce_run(static_cast<std::byte*>(segments[last].data), pending, t, op);
                pending = 0;
                return;
            }
            if (staging_.size() < pending * elem)
                staging_.resize(std::max(options_.pack_below.count() * 4, pending * elem * 2));
            std::size_t at = 0;
            for (std::size_t i = first_small; i < end; ++i)
                if (is_small(segments[i])) {
                    std::memcpy(staging_.data() + at * elem, segments[i].data, segments[i].count * elem);
                    at += segments[i].count;
                }
            reduce_run(staging_.data(), pending, t, op);
            at = 0;
            for (std::size_t i = first_small; i < end; ++i)
                if (is_small(segments[i])) {
                    std::memcpy(segments[i].data, staging_.data() + at * elem, segments[i].count * elem);
                    at += segments[i].count;
                }
            pending = 0;
        };
        for (std::size_t i = 0; i < segments.size(); ++i) {
            const auto& s = segments[i];
            if (s.count == 0) continue;
            if (!is_small(s)) {
                reduce_run(static_cast<std::byte*>(s.data), s.count, t, op);
                continue;
            }
            if (pending == 0) first_small = i;
            pending += s.count;
            if (pending * elem >= options_.chunk.count()) flush(i + 1);
        }
        flush(segments.size());
    }

    // In place: this rank's shard (shard_of) of the elements in `segments`, laid end to end (one
    // segment: a buffer), ends with their reduction over the ranks; the rest holds partial sums.
    // A ring, in rounds that move at most options_.chunk in all: part p is summed along the ring
    // ending at rank p.
    void reduce_scatter(std::span<const Segment> segments, DType t, ReduceOp op) {
        const int n = size_;
        const std::size_t elem = size_of(t);
        if (n == 1) return;
        const ScatteredElements data(segments, elem);
        const std::size_t count = data.count(), q = round_elements(elem);
        if (scratch_.size() < q * elem) scratch_.resize(q * elem);
        const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
        for (std::size_t done = 0; done < shard_of(count, n, 0).count; done += q) {
            const RoundParts part{count, n, done, q};
            for (int step = 0; step + 1 < n; ++step) {
                const int send = (rank_ - step - 1 + 2 * n) % n, recv = (rank_ - step - 2 + 2 * n) % n;
                const MpiRange out(data, part.begin(send), part.length(send), elem);
                check(MPI_Sendrecv(out.buffer(), out.count(), out.type(), right, ring_tag, scratch_.data(),
                                   static_cast<int>(part.length(recv) * elem), MPI_BYTE, left, ring_tag, comm_,
                                   MPI_STATUS_IGNORE),
                      "MPI_Sendrecv");
                const double factor = step + 2 == n && op == ReduceOp::average ? 1.0 / n : 1.0;
                std::size_t from = 0;
                data.for_each_run(part.begin(recv), part.length(recv), [&](std::byte* p, std::size_t k) {
                    add_received(p, scratch_.data() + from * elem, k, t, factor);
                    from += k;
                });
            }
        }
    }

    // In place: every rank's shard of the elements of `elem` bytes in `segments` (laid end to
    // end) reaches every other rank, passed along the ring in rounds that move at most
    // options_.chunk in all.
    void all_gather(std::span<const Segment> segments, std::size_t elem) {
        const int n = size_;
        if (n == 1) return;
        const ScatteredElements data(segments, elem);
        const std::size_t count = data.count(), q = round_elements(elem);
        const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
        for (std::size_t done = 0; done < shard_of(count, n, 0).count; done += q) {
            const RoundParts part{count, n, done, q};
            for (int step = 0; step + 1 < n; ++step) {
                const int send = (rank_ - step + n) % n, recv = (rank_ - step - 1 + n) % n;
                const MpiRange out(data, part.begin(send), part.length(send), elem);
                const MpiRange in(data, part.begin(recv), part.length(recv), elem);
                check(MPI_Sendrecv(out.buffer(), out.count(), out.type(), right, ring_tag, in.buffer(), in.count(),
                                   in.type(), left, ring_tag, comm_, MPI_STATUS_IGNORE),
                      "MPI_Sendrecv");
            }
        }
    }

private:
    static constexpr int ring_tag = 0x6773;  // on our own communicator: no other messages to confuse it with

    // One round of a sharded ring: elements [done, done + q) of each rank's shard, where it has them.
    struct RoundParts {
        std::size_t count;
        int ranks;
        std::size_t done, q;
        [[nodiscard]] std::size_t begin(int p) const { return shard_of(count, ranks, p).offset + done; }
        [[nodiscard]] std::size_t length(int p) const {
            const std::size_t c = shard_of(count, ranks, p).count;
            return c > done ? std::min(q, c - done) : 0;
        }
    };

    // Elements of each part per round: the chunk shared out over the parts.
    [[nodiscard]] std::size_t round_elements(std::size_t elem) const {
        const std::size_t chunk = std::min<std::size_t>(options_.chunk.count(), std::size_t{1} << 30);
        return std::max<std::size_t>(1, chunk / elem / static_cast<std::size_t>(size_));
    }

    void check(int rc, const char* call) const {
        if (rc != MPI_SUCCESS) throw CollectiveError(who_ + ": " + call + " failed: " + mpi_error_string(rc));
    }

    [[nodiscard]] MPI_Datatype mpi_type(DType t) const {
        switch (t) {
            case DType::float64: return MPI_DOUBLE;
            case DType::float16:
            case DType::bfloat16: return half_type_;
            default: return MPI_FLOAT;
        }
    }
    [[nodiscard]] MPI_Op mpi_sum(DType t) const {
        if (t == DType::float16) return sum_f16_;
        if (t == DType::bfloat16) return sum_bf16_;
        return MPI_SUM;
    }

    // In place, `count` elements at `data`, in pieces of options_.chunk.
    void reduce_run(std::byte* data, std::size_t count, DType t, ReduceOp op) {
        const std::size_t elem = size_of(t);
        const std::size_t chunk =
            std::max<std::size_t>(1, std::min<std::size_t>(options_.chunk.count(), std::size_t{1} << 30) / elem);
        for (std::size_t off = 0; off < count; off += chunk) {
            const std::size_t k = std::min(chunk, count - off);
            std::byte* p = data + off * elem;
            const bool ring = options_.algorithm == MpiAlgorithm::ring ||
                              (options_.algorithm == MpiAlgorithm::automatic && k * elem >= options_.ring_min.count());
            if (ring && k >= std::size_t(size_)) {
                ring_allreduce(p, k, t, op);
            } else {
                check(MPI_Allreduce(MPI_IN_PLACE, p, static_cast<int>(k), mpi_type(t), mpi_sum(t), comm_),
                      "MPI_Allreduce");
                if (op == ReduceOp::average) average_elements(p, k, t, size_);
            }
        }
    }

    // Ring allreduce of `count` elements at `data`, in place. Part i of the n parts is summed
    // along the ring ending at rank i - 1 (mod n), which averages it in the same pass, and is then
    // passed around: every rank ends with the same bits.
    void ring_allreduce(std::byte* data, std::size_t count, DType t, ReduceOp op) {
        const int n = size_;
        const std::size_t elem = size_of(t);
        auto begin = [&](int part) { return count * std::size_t(part) / std::size_t(n); };
        auto length = [&](int part) { return begin(part + 1) - begin(part); };
        const std::size_t most = (count + std::size_t(n) - 1) / std::size_t(n);
        if (scratch_.size() < most * elem) scratch_.resize(most * elem);
        const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
        for (int step = 0; step + 1 < n; ++step) {
            const int send = (rank_ - step + 2 * n) % n, recv = (rank_ - step - 1 + 2 * n) % n;
            check(MPI_Sendrecv(data + begin(send) * elem, static_cast<int>(length(send) * elem), MPI_BYTE, right,
                               ring_tag, scratch_.data(), static_cast<int>(length(recv) * elem), MPI_BYTE, left,
                               ring_tag, comm_, MPI_STATUS_IGNORE),
                  "MPI_Sendrecv");
            const bool last = step + 2 == n;
            add_received(data + begin(recv) * elem, scratch_.data(), length(recv), t,
                         last && op == ReduceOp::average ? 1.0 / n : 1.0);
        }
        for (int step = 0; step + 1 < n; ++step) {
            const int send = (rank_ + 1 - step + 2 * n) % n, recv = (rank_ - step + 2 * n) % n;
            check(MPI_Sendrecv(data + begin(send) * elem, static_cast<int>(length(send) * elem), MPI_BYTE, right,
                               ring_tag, data + begin(recv) * elem, static_cast<int>(length(recv) * elem), MPI_BYTE,
                               left, ring_tag, comm_, MPI_STATUS_IGNORE),
                  "MPI_Sendrecv");
        }
    }

    MPI_Comm comm_;
    const MpiOptions& options_;
    std::string who_;  // begins every message
    int rank_ = 0;
    int size_ = 1;
    MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
    MPI_Op sum_f16_ = MPI_OP_NULL;
    MPI_Op sum_bf16_ = MPI_OP_NULL;
    std::vector<std::byte> staging_;  // small segments packed together
    std::vector<std::byte> scratch_;  // the ring's received part
};

}  // namespace gradsync::inline v0::detail
