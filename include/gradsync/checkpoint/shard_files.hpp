// The files of optimizer state split across the ranks (ShardedDataParallel): each rank writes
// its pieces to a shard file of its own beside the checkpoint, one tensor per state array and
// parameter, with the piece's first element in the parameter; the checkpoint lists every shard
// file with a hash of its contents. Reading fills a rank's pieces from whichever shard files hold
// them, so a checkpoint saved by N ranks loads into any number of ranks and any bucket plan.
#pragma once

#include <gradsync/checkpoint/safetensors.hpp>
#include <gradsync/checkpoint/safetensors_file.hpp>
#include <gradsync/detail/hash.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/model/model.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>  // for std::sort, std::find, std::max, std::min
#include <charconv>   // for std::from_chars
#include <cstddef>
#include <cstdint>
#include <cstring>  // for std::memcpy
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <system_error>  // for std::error_code, std::errc
#include <utility>       // for std::pair
#include <vector>

namespace gradsync::inline v0::detail {

// One optimizer state array of a rank: state_elements() elements, indexed by state offsets.
struct ShardedArray {
    std::string name;
    void* data = nullptr;
    std::size_t count = 0;
    DType dtype = DType::float32;
};

// Where one of the rank's pieces lies: in which parameter, from which element, how many, and
// where its state begins in the state arrays.
struct PieceSpan {
    std::size_t parameter = 0;
    std::size_t offset = 0;
    std::size_t count = 0;
    std::size_t state_offset = 0;
};

// The shard files a checkpoint lists.
struct ShardList {
    std::uint64_t step = 0;
    std::vector<std::string> names;  // by saving rank, relative to the checkpoint's folder
    std::vector<std::uint64_t> hashes;
};

inline std::string shard_file_name(const std::filesystem::path& checkpoint, std::uint64_t step, int rank, int ranks) {
    return checkpoint.filename().string() + ".step-" + std::to_string(step) + ".shard-" + std::to_string(rank) +
           "-of-" + std::to_string(ranks) + ".safetensors";
}

// Whether `name` is a shard file of `checkpoint` (any step, rank, world size), or with `kind`
// "rank", a file of state that differs by rank (local_files.hpp).
inline bool is_shard_file_of(const std::filesystem::path& checkpoint, const std::string& name,
                             const std::string& kind = "shard") {
    const std::string head = checkpoint.filename().string() + ".step-", tail = ".safetensors";
    if (name.size() <= head.size() + tail.size() || !name.starts_with(head) || !name.ends_with(tail)) return false;
    const std::string middle = name.substr(head.size(), name.size() - head.size() - tail.size());
    std::size_t at = 0;
    auto digits = [&] {
        const std::size_t from = at;
        while (at < middle.size() && middle[at] >= '0' && middle[at] <= '9') ++at;
        return at > from;
    };
    auto word = [&](const std::string& w) {
        if (middle.compare(at, w.size(), w) != 0) return false;
        at += w.size();
        return true;
    };
    return digits() && word("." + kind + "-") && digits() && word("-of-") && digits() && at == middle.size();
}

// What a shard's hash covers: its tensors' names, dtypes and bytes, and its metadata.
inline std::uint64_t shard_hash(std::vector<const TensorBytes*> tensors,
                                const std::map<std::string, std::string>& meta) {
    std::sort(tensors.begin(), tensors.end(), [](const auto* a, const auto* b) { return a->name < b->name; });
    Fnv1a h;
    for (const auto* t : tensors)
        h.add(content_hash(t->name.data(), t->name.size()))
            .add(static_cast<std::uint64_t>(t->dtype))
            .add(content_hash(t->bytes.data(), t->bytes.size()));
    for (const auto& [key, value] : meta)
        h.add(content_hash(key.data(), key.size())).add(content_hash(value.data(), value.size()));
    return h.value();
}

// The number `text` holds, or false.
inline bool read_u64(const std::string& text, std::uint64_t& out) {
    const auto r = std::from_chars(text.data(), text.data() + text.size(), out);
    return r.ec == std::errc{} && r.ptr == text.data() + text.size();
}

inline std::string shard_tensor_name(const ShardedArray& array, const Parameter& param) {
    return array.name + "." + param.name;
}

// Writes this rank's pieces of every array to its shard file (atomically); returns its hash.
inline std::uint64_t write_shard(const std::filesystem::path& path, std::span<const ShardedArray> arrays,
                                 std::span<const PieceSpan> pieces, std::span<const Parameter> params,
                                 std::uint64_t step, int rank, int ranks, const SafetensorsWriteOptions& options) {
    std::vector<TensorBytes> tensors;
    std::map<std::string, std::string> meta{{"format", "pt"},
                                            {"gradsync.step", std::to_string(step)},
                                            {"gradsync.shard", std::to_string(rank)},
                                            {"gradsync.shards", std::to_string(ranks)}};
    for (const auto& a : arrays)
        for (const auto& p : pieces) {
            const std::size_t size = size_of(a.dtype);
            const auto& param = params[p.parameter];
            TensorBytes t{shard_tensor_name(a, param),
                          a.dtype,
                          {p.count},
                          std::span(static_cast<const std::byte*>(a.data) + p.state_offset * size, p.count * size)};
            meta["gradsync.offset." + t.name] = std::to_string(p.offset);
            meta["gradsync.elements." + t.name] = std::to_string(param.count);
            tensors.push_back(std::move(t));
        }
    write_safetensors(path, tensors, meta, options);
    std::vector<const TensorBytes*> all;
    for (const auto& t : tensors) all.push_back(&t);
    return shard_hash(std::move(all), meta);
}

// Fills `out` (one vector per array, of the array's bytes) with this rank's pieces read from the
// shard files listed; returns "" or the first problem found. Reads this rank's own file first and
// others only for what it lacks (a load into another world size or bucket plan).
inline std::string read_shards(const std::filesystem::path& checkpoint, const ShardList& list,
                               std::span<const ShardedArray> arrays, std::span<const PieceSpan> pieces,
                               std::span<const Parameter> params, int rank, std::vector<std::vector<std::byte>>& out) {
    // Which array and parameter each tensor name would fill, and this rank's piece of each parameter.
    std::map<std::string, std::pair<std::size_t, std::size_t>> target;
    for (std::size_t a = 0; a < arrays.size(); ++a)
        for (std::size_t p = 0; p < params.size(); ++p) target[shard_tensor_name(arrays[a], params[p])] = {a, p};
    std::map<std::size_t, std::size_t> piece_of;  // parameter -> index into pieces
    for (std::size_t i = 0; i < pieces.size(); ++i) piece_of[pieces[i].parameter] = i;
    // Covered element ranges, per array and piece: overlaps are an error, gaps are found at the end.
    std::vector<std::vector<std::vector<std::pair<std::size_t, std::size_t>>>> covered(
        arrays.size(), std::vector<std::vector<std::pair<std::size_t, std::size_t>>>(pieces.size()));
    std::size_t missing = 0;
    out.assign(arrays.size(), {});
    for (std::size_t a = 0; a < arrays.size(); ++a) {
        out[a].assign(arrays[a].count * size_of(arrays[a].dtype), std::byte{0});
        for (const auto& p : pieces) missing += p.count;
    }
    const auto folder = checkpoint.parent_path();
    std::vector<std::size_t> order;
    if (rank >= 0 && static_cast<std::size_t>(rank) < list.names.size())
        order.push_back(static_cast<std::size_t>(rank));
    for (std::size_t r = 0; r < list.names.size(); ++r)
        if (r != static_cast<std::size_t>(rank)) order.push_back(r);
    for (const std::size_t r : order) {
        if (missing == 0) break;
        const auto path = folder / list.names[r];
        const std::string where = "gradsync: shard " + std::to_string(r) + " of checkpoint " + checkpoint.string() +
                                  " (" + path.string() + ")";
        try {
            const SafetensorsFile file(path);
            std::vector<const TensorBytes*> all;
            for (const auto& t : file.tensors()) all.push_back(&t);
            if (shard_hash(all, file.metadata()) != list.hashes[r])
                return where +
                       " is not the one the checkpoint lists: its contents differ (written by another save, "
                       "or changed since)";
            for (const auto& t : file.tensors()) {
                const auto it = target.find(t.name);
                if (it == target.end()) return where + " holds tensor '" + t.name + "', which nothing here loads";
                const auto [a, p] = it->second;
                if (t.dtype != arrays[a].dtype)
                    return where + ": tensor '" + t.name + "' is " + to_string(t.dtype) + " there and " +
                           to_string(arrays[a].dtype) + " here";
                std::uint64_t offset = 0, elements = 0;
                const auto& meta = file.metadata();
                const auto o = meta.find("gradsync.offset." + t.name), e = meta.find("gradsync.elements." + t.name);
                if (o == meta.end() || e == meta.end() || !read_u64(o->second, offset) ||
                    !read_u64(e->second, elements))
                    return where + " lacks a readable offset or size of tensor '" + t.name + "'";
                const std::size_t size = size_of(t.dtype), count = t.bytes.size() / size;
                if (elements != params[p].count)
                    return where + ": tensor '" + t.name + "' is state of a parameter of " + std::to_string(elements) +
                           " elements there and " + std::to_string(params[p].count) + " here";
                if (offset > elements || count > elements - offset)
                    return where + ": tensor '" + t.name + "' runs past its parameter's " + std::to_string(elements) +
                           " elements";
                const auto mine = piece_of.find(p);
                if (mine == piece_of.end()) continue;
                const auto& piece = pieces[mine->second];
                const std::size_t lo = std::max<std::size_t>(offset, piece.offset),
                                  hi = std::min<std::size_t>(offset + count, piece.offset + piece.count);
                if (lo >= hi) continue;
                auto& ranges = covered[a][mine->second];
                for (const auto& [b, e2] : ranges)
                    if (lo < e2 && b < hi)
                        return where + ": elements " + std::to_string(std::max(lo, b)) + ".." +
                               std::to_string(std::min(hi, e2) - 1) + " of tensor '" + t.name +
                               "' are also in another shard";
                ranges.emplace_back(lo, hi);
                std::memcpy(out[a].data() + (piece.state_offset + (lo - piece.offset)) * size,
                            t.bytes.data() + (lo - offset) * size, (hi - lo) * size);
                missing -= hi - lo;
            }
        } catch (const std::exception& e) {  // the reader's message names the shard file
            std::string what = e.what();
            if (what.starts_with("gradsync: ")) what.erase(0, 10);
            return "gradsync: shard " + std::to_string(r) + " of checkpoint " + checkpoint.string() + ": " + what;
        }
    }
    if (missing == 0) return {};
    for (std::size_t a = 0; a < arrays.size(); ++a)
        for (std::size_t i = 0; i < pieces.size(); ++i) {
            auto ranges = covered[a][i];
            std::sort(ranges.begin(), ranges.end());
            std::size_t at = pieces[i].offset;
            for (const auto& [b, e] : ranges) {
                if (b != at) break;
                at = e;
            }
            if (at != pieces[i].offset + pieces[i].count)
                return "gradsync: checkpoint " + checkpoint.string() + ": no shard holds element " +
                       std::to_string(at) + " of '" + shard_tensor_name(arrays[a], params[pieces[i].parameter]) +
                       "' (of " + std::to_string(list.names.size()) + " shards)";
        }
    return {};
}

// The shard list as one string, to broadcast from the rank that read the checkpoint.
inline std::string to_text(const ShardList& list) {
    return nlohmann::json{{"step", list.step}, {"names", list.names}, {"hashes", list.hashes}}.dump();
}
inline ShardList shard_list_from_text(const std::string& text) {
    const auto j = nlohmann::json::parse(text);
    return ShardList{j.at("step").get<std::uint64_t>(), j.at("names").get<std::vector<std::string>>(),
                     j.at("hashes").get<std::vector<std::uint64_t>>()};
}

// The files a checkpoint lists beside itself, one per rank: shard files of sharded optimizer
// state, or rank files of state that differs by rank.
struct FileListKind {
    const char* key;       // in the checkpoint's metadata
    const char* files;     // "shard", "rank"
    const char* absent;    // "holds no " + absent + ", but 'x' is wanted"
    const char* unwanted;  // "holds " + unwanted, when none is wanted
};
inline constexpr FileListKind shard_files{
    "gradsync.shards", "shard", "sharded state",
    "optimizer state split across the ranks in shard files; load it into a ShardedDataParallel, with "
    "Checkpoint::add_shard for each state array"};
inline constexpr FileListKind rank_files{
    "gradsync.local", "rank", "state that differs by rank",
    "state that differs by rank in files of each rank; load it with Checkpoint::add_local"};

// Checks that `file` lists `kind`'s files exactly when such state is wanted (`arrays` not empty),
// and that its list is well formed; puts the list's text in `text`. Empty or the problem.
inline std::string read_file_list(const SafetensorsFile& file, const FileListKind& kind, std::uint64_t step,
                                  std::span<const ShardedArray> arrays, std::string& text) {
    const std::string where = "gradsync: checkpoint " + file.path().string();
    const std::string files = std::string(kind.files) + " file";
    const auto it = file.metadata().find(kind.key);
    if (it == file.metadata().end())
        return arrays.empty() ? ""
                              : where + " holds no " + kind.absent + ", but '" + arrays.front().name + "' is wanted";
    if (arrays.empty()) return where + " holds " + kind.unwanted;
    try {
        const auto list = shard_list_from_text(it->second);
        if (list.names.empty() || list.names.size() != list.hashes.size() || list.step != step)
            return where + ": its list of " + files + "s is inconsistent";
        for (const auto& name : list.names)
            if (name.empty() || std::filesystem::path(name).filename().string() != name)
                return where + ": " + files + " name '" + excerpt(name) + "' is not a plain file name";
    } catch (const std::exception&) {
        return where + ": its list of " + files + "s is unreadable: '" + excerpt(it->second) + "'";
    }
    text = it->second;
    return {};
}

// Removes the shard files (or with `kind` "rank", the rank files) of `checkpoint` in its folder
// that `list` does not name: those of earlier saves, and of saves a crash interrupted. Errors are
// ignored (another rank may remove the same file at once).
inline void remove_stale_shards(const std::filesystem::path& checkpoint, const ShardList& list,
                                const std::string& kind = "shard") {
    std::error_code ec;
    const auto folder = checkpoint.parent_path().empty() ? std::filesystem::path(".") : checkpoint.parent_path();
    std::vector<std::filesystem::path> stale;
    for (const auto& entry : std::filesystem::directory_iterator(folder, ec)) {
        const auto name = entry.path().filename().string();
        if (is_shard_file_of(checkpoint, name, kind) &&
            std::find(list.names.begin(), list.names.end(), name) == list.names.end())
            stale.push_back(entry.path());
    }
    for (const auto& p : stale) std::filesystem::remove(p, ec);
}

}  // namespace gradsync::inline v0::detail
