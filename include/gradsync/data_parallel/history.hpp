// CollectiveHistory: every collective a DataParallel or ShardedDataParallel issues gets a tag that
// says what it is for
// (which step, which bucket) and a fingerprint that folds in every collective before it, so that
// ranks whose histories diverged are caught: at each call by a backend that compares tags
// (CheckedCollectives), or once per step by comparing fingerprints (and the trainer's step
// number, where it passes one) with one small allreduce.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/data_parallel/rank_table.hpp>
#include <gradsync/detail/hash.hpp>
#include <gradsync/error.hpp>

#include <chrono>
#include <cstddef>  // for std::byte
#include <cstdint>
#include <optional>
#include <random>  // for std::random_device
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

// What a collective is for.
enum class CollectivePurpose : std::uint8_t {
    bucket,            // a bucket's gradients (averaged, or reduce-scattered into shards)
    buffer_broadcast,  // a model buffer, rank 0's copied to every rank
    buffer_average,    // a model buffer, averaged
    float_redo,        // a bucket again, in float32, after its float16 sum overflowed
    shard_gather,      // a bucket's parameters, each rank's updated shard gathered to every rank
    step_decision,     // the norm and the finite check of the sharded gradients
    overflow_report,   // which parameters overflowed, after the ranks agreed that one did
};

class CollectiveHistory {
public:
    // Gives this history an identity of its own, the same on every rank (collective: rank 0 draws
    // it and broadcasts it), so that two wrappers of one model layout on one backend never issue
    // matching collectives: a rank that steps them in another order is caught like any other
    // divergence, instead of averaging one wrapper's gradients with the other's.
    template <Backend B>
    void take_identity(B& backend) {
        std::uint64_t identity = 0;
        if (backend.rank() == 0) {
            std::random_device entropy;
            identity = (std::uint64_t{entropy()} << 32) ^ entropy() ^
                       static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
        }
        if (backend.size() > 1) backend.broadcast(std::as_writable_bytes(std::span(&identity, 1)), 0);
        fingerprint_ = fnv1a(fnv1a_basis, identity);
    }

    // The tag of the next collective: `index` is the bucket's, or the buffer's.
    CollectiveTag next(CollectivePurpose purpose, std::int64_t step, std::size_t index, std::uint64_t bytes,
                       DType dtype) {
        ++count_;
        fingerprint_ = fnv1a(fingerprint_, count_);
        fingerprint_ = fnv1a(fingerprint_, static_cast<std::uint64_t>(purpose));
        fingerprint_ = fnv1a(fingerprint_, index);
        fingerprint_ = fnv1a(fingerprint_, bytes);
        fingerprint_ = fnv1a(fingerprint_, static_cast<std::uint64_t>(dtype));
        const bool of_bucket = purpose == CollectivePurpose::bucket || purpose == CollectivePurpose::float_redo ||
                               purpose == CollectivePurpose::shard_gather;
        return CollectiveTag{fingerprint_, step, of_bucket ? static_cast<std::int32_t>(index) : -1};
    }

    [[nodiscard]] std::uint64_t fingerprint() const { return fingerprint_; }
    [[nodiscard]] std::uint64_t count() const { return count_; }
    // Bytes of the gradients' collectives (buckets, their redos, a hook's) so far: each counted by
    // whoever hands them to the backend (add_reduced).
    [[nodiscard]] std::uint64_t bytes_reduced() const { return bytes_reduced_; }
    void add_reduced(std::uint64_t bytes) { bytes_reduced_ += bytes; }

    // Compares every rank's history with rank 0's (one allreduce of a small table), and the
    // trainer's step number where it passed one; throws the same HistoryMismatch (StepMismatch
    // for the step numbers) on every rank when one differs.
    template <Backend B>
    void verify(B& backend, std::int64_t step, std::optional<std::uint64_t> trainer_step = {}) const {
        const int world = backend.size();
        if (world == 1) return;
        enum : std::size_t { fingerprint, count, has_step, step_number, columns };
        RankTable table(world, backend.rank(), columns);
        table.set(fingerprint, fingerprint_);
        table.set(count, count_);
        table.set(has_step, trainer_step.has_value());
        table.set(step_number, trainer_step.value_or(0));
        table.gather(backend);
        const auto number = [&](int r) {
            return table.at(r, has_step) == 0 ? std::string("none") : std::to_string(table.at(r, step_number));
        };
        for (int r = 1; r < world; ++r) {
            if (!table.same_as_rank0(r, has_step) || !table.same_as_rank0(r, step_number))
                throw StepMismatch("gradsync: step " + std::to_string(step) +
                                   ": the ranks are at different steps of the trainer: rank 0 passed step number " +
                                   number(0) + " and rank " + std::to_string(r) + " " + number(r) +
                                   "; a rank skipped or repeated an iteration, and its gradients were about to be "
                                   "averaged with another iteration's");
            if (table.same_as_rank0(r, fingerprint)) continue;
            throw HistoryMismatch("gradsync: step " + std::to_string(step) +
                                  ": the ranks' collective histories diverged: rank 0 issued " +
                                  std::to_string(table.at(0, count)) + " collectives and rank " + std::to_string(r) +
                                  " " + std::to_string(table.at(r, count)) +
                                  ", with different fingerprints; every rank must launch the same buckets in the "
                                  "same order, and step its DataParallel objects in the same order");
        }
    }

private:
    std::uint64_t fingerprint_ = fnv1a_basis;
    std::uint64_t count_ = 0;
    std::uint64_t bytes_reduced_ = 0;
};

}  // namespace gradsync::inline v0::detail
