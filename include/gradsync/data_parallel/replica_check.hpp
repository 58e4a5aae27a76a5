// Replica consistency: what every rank should hold bit for bit (the parameters, the buffers kept
// equal, checkpointed optimizer state) hashed on every rank and compared, so that replicas that
// drifted apart (a rank that skipped or repeated a step, changed parameters on its own, loaded
// other values) are caught and named instead of training on silently.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/data_parallel/rank_table.hpp>
#include <gradsync/detail/hash.hpp>
#include <gradsync/error.hpp>
#include <gradsync/model/buffers.hpp>
#include <gradsync/model/model.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

// One tensor whose bytes every rank must hold alike.
struct ReplicaTensor {
    const std::string* name;
    const char* kind;  // "parameter", "buffer", "checkpointed tensor"
    const void* data;
    std::size_t bytes;
};

// What every rank holds alike between steps: the parameters, and the buffers a policy keeps equal
// at every step (not those broadcast once or left alone: they may differ by design).
inline std::vector<ReplicaTensor> replica_tensors(std::span<const Parameter> params,
                                                  std::span<const ModelBuffer> buffers, BufferSync mode) {
    std::vector<ReplicaTensor> out;
    out.reserve(params.size() + buffers.size());
    for (const auto& p : params) out.push_back(ReplicaTensor{&p.name, "parameter", p.data, p.bytes().count()});
    if (mode == BufferSync::broadcast_every_step || mode == BufferSync::average_every_step)
        for (const auto& b : buffers) out.push_back(ReplicaTensor{&b.name, "buffer", b.data, b.bytes().count()});
    return out;
}

// Where the ranks' lists of hashes differ from rank 0's.
struct RankDifference {
    bool lengths_differ = false;  // then first and differing say nothing
    std::size_t first = 0;        // the first index where a rank differs
    std::string ranks;            // the ranks that differ there: "2" or "1, 3"
    std::size_t differing = 0;    // how many indices differ
    [[nodiscard]] std::string rank_words() const {
        return (ranks.find(',') == std::string::npos ? "rank " : "ranks ") + ranks;
    }
};

// Compares every rank's list of hashes with rank 0's: one allreduce of the list's length and one
// hash of it per rank, and only when they differ (and the lengths agree) a second one of the
// whole list, to find the first index that differs. The same answer on every rank. Collective.
template <Backend B>
std::optional<RankDifference> compare_with_rank0(B& backend, std::span<const std::uint64_t> hashes) {
    const int world = backend.size();
    if (world == 1) return std::nullopt;
    Fnv1a whole;
    for (auto h : hashes) whole.add(h);
    enum : std::size_t { of_whole, length, columns };
    RankTable summary(world, backend.rank(), columns);
    summary.set(of_whole, whole.value());
    summary.set(length, hashes.size());
    summary.gather(backend);
    RankDifference d;
    bool all_same = true;
    for (int r = 1; r < world; ++r) {
        const bool length_same = summary.same_as_rank0(r, length);
        if (length_same && summary.same_as_rank0(r, of_whole)) continue;
        all_same = false;
        if (!length_same) {
            d.lengths_differ = true;
            d.ranks += (d.ranks.empty() ? "" : ", ") + std::to_string(r);
        }
    }
    if (all_same) return std::nullopt;
    if (d.lengths_differ) return d;

    const auto n = hashes.size();
    RankTable table(world, backend.rank(), n);
    for (std::size_t i = 0; i < n; ++i) table.set(i, hashes[i]);
    table.gather(backend);
    d.first = n;
    for (std::size_t i = 0; i < n; ++i) {
        bool differs = false;
        for (int r = 1; r < world; ++r) {
            if (table.same_as_rank0(r, i)) continue;
            differs = true;
            if (d.first == n) d.ranks += (d.ranks.empty() ? "" : ", ") + std::to_string(r);
        }
        if (differs && d.first == n) d.first = i;
        d.differing += differs;
    }
    return d;
}

// Compares every rank's tensors with rank 0's by content hash; throws the same ReplicaMismatch on
// every rank, naming the first tensor that differs and the ranks that hold another value. `when`
// says where the check ran ("step 100"). Collective: every rank calls it with its tensors.
template <Backend B>
void compare_replicas(B& backend, std::span<const ReplicaTensor> tensors, const std::string& when) {
    if (backend.size() == 1) return;
    std::vector<std::uint64_t> hashes;
    hashes.reserve(tensors.size());
    for (const auto& t : tensors) hashes.push_back(content_hash(t.data, t.bytes));
    const auto d = compare_with_rank0(backend, std::span<const std::uint64_t>(hashes));
    if (!d) return;
    std::string what = "gradsync: " + when + ": the ranks' replicas differ: ";
    if (d->lengths_differ) {
        what += d->rank_words() + " compared another number of tensors than rank 0";
    } else {
        const auto& t = tensors[d->first];
        what += std::string(t.kind) + " '" + *t.name + "' on " + d->rank_words() + " is not rank 0's (" +
                std::to_string(d->differing) + " of " + std::to_string(tensors.size()) + " tensors differ)";
    }
    throw ReplicaMismatch(what +
                          "; the ranks' updates diverged: a rank skipped or repeated a synchronize() or an "
                          "optimizer step, changed values on its own, or loaded other values. Passing the "
                          "trainer's step number to synchronize() or step() catches a skipped step where it "
                          "happens");
}

}  // namespace gradsync::inline v0::detail
