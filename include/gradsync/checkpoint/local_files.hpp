// The files of state that differs by rank (a communication hook's error feedback): each rank
// writes its own arrays to a file of its own beside the checkpoint, which lists every rank's file
// with a hash of its contents; a load reads each rank's own file back, into as many ranks as saved.
#pragma once

#include <gradsync/checkpoint/safetensors.hpp>
#include <gradsync/checkpoint/safetensors_file.hpp>
#include <gradsync/checkpoint/shard_files.hpp>
#include <gradsync/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>  // for std::memcpy
#include <filesystem>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0::detail {

inline std::string local_file_name(const std::filesystem::path& checkpoint, std::uint64_t step, int rank, int ranks) {
    return checkpoint.filename().string() + ".step-" + std::to_string(step) + ".rank-" + std::to_string(rank) + "-of-" +
           std::to_string(ranks) + ".safetensors";
}

// Writes this rank's arrays to its file (atomically); returns its hash.
inline std::uint64_t write_local(const std::filesystem::path& path, std::span<const ShardedArray> arrays,
                                 std::uint64_t step, int rank, int ranks, const SafetensorsWriteOptions& options) {
    std::vector<TensorBytes> tensors;
    const std::map<std::string, std::string> meta{{"format", "pt"},
                                                  {"gradsync.step", std::to_string(step)},
                                                  {"gradsync.rank", std::to_string(rank)},
                                                  {"gradsync.ranks", std::to_string(ranks)}};
    for (const auto& a : arrays)
        tensors.push_back(TensorBytes{
            a.name, a.dtype, {a.count}, std::span(static_cast<const std::byte*>(a.data), a.count * size_of(a.dtype))});
    write_safetensors(path, tensors, meta, options);
    std::vector<const TensorBytes*> all;
    for (const auto& t : tensors) all.push_back(&t);
    return shard_hash(std::move(all), meta);
}

// Fills `out` (one vector per array, of its bytes) from this rank's file of those `list` names;
// returns "" or the first problem found.
inline std::string read_local(const std::filesystem::path& checkpoint, const ShardList& list,
                              std::span<const ShardedArray> arrays, int rank, int ranks,
                              std::vector<std::vector<std::byte>>& out) {
    const std::string of = "gradsync: checkpoint " + checkpoint.string();
    if (list.names.size() != static_cast<std::size_t>(ranks))
        return of + " holds state that differs by rank, saved by " + std::to_string(list.names.size()) +
               " ranks; it loads into as many ranks, not " + std::to_string(ranks);
    const auto r = static_cast<std::size_t>(rank);
    const auto path = checkpoint.parent_path() / list.names[r];
    const std::string where = "gradsync: rank " + std::to_string(rank) + "'s state of checkpoint " +
                              checkpoint.string() + " (" + path.string() + ")";
    try {
        const SafetensorsFile file(path);
        std::vector<const TensorBytes*> all;
        for (const auto& t : file.tensors()) all.push_back(&t);
        if (shard_hash(all, file.metadata()) != list.hashes[r])
            return where +
                   " is not the one the checkpoint lists: its contents differ (written by another save, or "
                   "changed since)";
        std::set<std::string> wanted;
        out.assign(arrays.size(), {});
        for (std::size_t a = 0; a < arrays.size(); ++a) {
            wanted.insert(arrays[a].name);
            const auto* saved = file.find(arrays[a].name);
            if (saved == nullptr) return where + " has no tensor '" + arrays[a].name + "'";
            if (saved->dtype != arrays[a].dtype || saved->bytes.size() != arrays[a].count * size_of(arrays[a].dtype))
                return where + ": tensor '" + arrays[a].name + "' is " +
                       std::to_string(saved->bytes.size() / size_of(saved->dtype)) + " x " + to_string(saved->dtype) +
                       " there and " + std::to_string(arrays[a].count) + " x " + to_string(arrays[a].dtype) + " here";
            out[a].assign(saved->bytes.begin(), saved->bytes.end());
        }
        for (const auto& t : file.tensors())
            if (!wanted.contains(t.name)) return where + " holds tensor '" + t.name + "', which nothing here loads";
    } catch (const std::exception& e) {  // the reader's message names the file
        std::string what = e.what();
        if (what.starts_with("gradsync: ")) what.erase(0, 10);
        return "gradsync: rank " + std::to_string(rank) + "'s state of checkpoint " + checkpoint.string() + ": " + what;
    }
    return {};
}

}  // namespace gradsync::inline v0::detail
