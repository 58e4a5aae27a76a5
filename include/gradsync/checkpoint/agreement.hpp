// How the ranks of a checkpoint save or load agree: every rank learns the first rank's problem
// and throws it alike, text one rank read reaches every rank, and a rank that would load other
// tensors than rank 0 is found before anything is read; the files one per rank beside a
// checkpoint are listed on every rank.
#pragma once

#include <gradsync/buffer.hpp>
#include <gradsync/checkpoint/safetensors.hpp>  // for CheckpointError
#include <gradsync/checkpoint/shard_files.hpp>
#include <gradsync/data_parallel/replica_check.hpp>
#include <gradsync/detail/hash.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

// Sends `text` from `root` to every rank.
template <class B>
void broadcast_text(B& backend, std::string& text, int root) {
    if (backend.size() == 1) return;
    std::uint64_t length = text.size();
    backend.broadcast(std::as_writable_bytes(std::span(&length, 1)), root);
    text.resize(length);
    backend.broadcast(std::as_writable_bytes(std::span(text.data(), text.size())), root);
}

// The first rank's problem, on every rank: returns when no rank has one, else throws the
// problem of the lowest rank that has one, on every rank alike.
template <class B>
void agree_on_problem(B& backend, std::string problem) {
    if (backend.size() > 1) {
        std::vector<double> has(static_cast<std::size_t>(backend.size()), 0.0);
        has[static_cast<std::size_t>(backend.rank())] = problem.empty() ? 0.0 : 1.0;
        backend.allreduce(Buffer{has.data(), has.size(), DType::float64}, ReduceOp::sum);
        int root = -1;
        for (int r = 0; r < backend.size() && root < 0; ++r)
            if (has[static_cast<std::size_t>(r)] != 0.0) root = r;
        if (root < 0) return;
        broadcast_text(backend, problem, root);
    }
    if (!problem.empty()) throw CheckpointError(problem);
}

// Rank 0's message when a rank would load other tensors than rank 0 (a broadcast of rank 0's
// values into them would leave that rank half-restored), else "". Collective.
template <class B, class Tensor>
std::string differs_from_rank0(B& backend, const std::filesystem::path& path, std::span<const Tensor> wanted,
                               std::span<const ShardedArray> shards) {
    std::vector<std::uint64_t> hashes;
    for (const auto& t : wanted)
        hashes.push_back(Fnv1a{}
                             .add(content_hash(t.name.data(), t.name.size()))
                             .add(static_cast<std::uint64_t>(t.dtype))
                             .add(t.count)
                             .value());
    for (const auto& t : shards)  // their sizes differ from rank to rank
        hashes.push_back(
            Fnv1a{}.add(content_hash(t.name.data(), t.name.size())).add(static_cast<std::uint64_t>(t.dtype)).value());
    const auto d = compare_with_rank0(backend, std::span<const std::uint64_t>(hashes));
    if (!d || backend.rank() != 0) return d ? "another rank's problem" : "";
    std::string what =
        "gradsync: checkpoint " + path.string() + " cannot be loaded alike on every rank: " + d->rank_words();
    if (d->lengths_differ) {
        what += " would load another number of tensors than rank 0's " + std::to_string(wanted.size() + shards.size());
    } else if (d->first >= wanted.size()) {
        const auto& t = shards[d->first - wanted.size()];
        what += " would load sharded state #" + std::to_string(d->first - wanted.size()) +
                " otherwise than rank 0, which loads '" + t.name + "' as " + std::string(to_string(t.dtype));
    } else {
        const auto& t = wanted[d->first];
        what += " would load tensor #" + std::to_string(d->first) + " otherwise than rank 0, which loads '" + t.name +
                "' as " + std::to_string(t.count) + " x " + std::string(to_string(t.dtype));
    }
    return what +
           " (parameters, buffers, then the additions, in order); every rank must add the same tensors, "
           "of the same sizes, to its Checkpoint";
}

// One file per rank beside the checkpoint at `path`, named by name_of: write(this rank's path)
// writes this rank's and returns its hash; every rank returns the list with every hash. A
// failure on any rank throws on every rank.
template <class DP, class NameOf, class Write>
ShardList write_rank_files(DP& dp, NameOf name_of, const std::filesystem::path& path, Write&& write) {
    const int ranks = dp.world_size();
    ShardList list{dp.steps(), {}, std::vector<std::uint64_t>(static_cast<std::size_t>(ranks), 0)};
    for (int r = 0; r < ranks; ++r) list.names.push_back(name_of(path, dp.steps(), r, ranks));
    const auto mine = static_cast<std::size_t>(dp.rank());
    std::string problem;
    try {
        list.hashes[mine] = write(path.parent_path() / list.names[mine]);
    } catch (const std::exception& e) {
        problem = e.what();
    }
    agree_on_problem(dp.backend(), problem);
    for (int r = 0; r < ranks && ranks > 1; ++r)
        dp.backend().broadcast(std::as_writable_bytes(std::span(&list.hashes[static_cast<std::size_t>(r)], 1)), r);
    return list;
}

}  // namespace gradsync::inline v0::detail
