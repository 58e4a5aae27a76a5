// The safetensors file format (what Hugging Face's `safetensors` package reads): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
// then the tensors' bytes. Written atomically: a crash at any moment leaves either the previous
// file or the new one, never a mixture. Not included by <gradsync/gradsync.hpp>: it needs
// nlohmann/json (Debian: nlohmann-json3-dev), for the header only.
#pragma once

#include <gradsync/detail/file_descriptor.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>   // for open
#include <unistd.h>  // for write, fsync, close

#include <algorithm>  // for std::sort
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>   // for std::rename
#include <cstring>  // for std::strerror, std::memcpy
#include <filesystem>
#include <fstream>
#include <functional>  // for std::function
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0 {

// A checkpoint file could not be written, read, or does not fit what it is loaded into.
class CheckpointError : public Error {
public:
    using Error::Error;
};

// One tensor to write, or one read: name, dtype, shape and its bytes (row-major, contiguous).
struct TensorBytes {
    std::string name;
    DType dtype = DType::float32;
    std::vector<std::uint64_t> shape;
    std::span<const std::byte> bytes;
};

struct SafetensorsWriteOptions {
    // Test hook: called with the bytes written so far, after each write (a crash test kills the
    // process from here).
    std::function<void(std::size_t)> on_write;
};

namespace detail {

inline const char* safetensors_dtype(DType t) {
    switch (t) {
        case DType::float32: return "F32";
        case DType::float64: return "F64";
        case DType::float16: return "F16";
        case DType::bfloat16: return "BF16";
        case DType::int32: return "I32";
        case DType::int64: return "I64";
    }
    return "?";
}

inline std::optional<DType> dtype_from_safetensors(const std::string& s) {
    for (auto t : {DType::float32, DType::float64, DType::float16, DType::bfloat16, DType::int32, DType::int64})
        if (s == safetensors_dtype(t)) return t;
    return std::nullopt;
}

inline std::string errno_text() { return std::strerror(errno); }

}  // namespace detail

// Writes `tensors` (names unique) and `metadata` to `path` in the safetensors format, atomically:
// into a temporary file of this writer's own (`path` + ".tmp." + process and sequence, created
// exclusively, so that two writers of one path never share it), fsync, rename over `path`, fsync
// of the directory. Whatever is killed when, `path` holds one whole checkpoint. Throws
// CheckpointError.
inline void write_safetensors(const std::filesystem::path& path, std::span<const TensorBytes> tensors,
                              const std::map<std::string, std::string>& metadata,
                              const SafetensorsWriteOptions& options = {}) {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata.empty()) header["__metadata__"] = metadata;
    std::uint64_t offset = 0;
    for (const auto& t : tensors) {
        if (t.name.empty() || t.name == "__metadata__")
            throw CheckpointError("gradsync: cannot save a tensor named '" + t.name + "' to " + path.string());
        if (header.contains(t.name))
            throw CheckpointError("gradsync: two tensors named '" + t.name + "' in checkpoint " + path.string());
        std::uint64_t elements = 1;
        for (auto d : t.shape) elements *= d;
        if (elements * size_of(t.dtype) != t.bytes.size())
            throw CheckpointError("gradsync: tensor '" + t.name + "' has " + std::to_string(t.bytes.size()) +
                                  " bytes, but its shape and dtype say " + std::to_string(elements * size_of(t.dtype)));
        header[t.name] = {{"dtype", detail::safetensors_dtype(t.dtype)},
                          {"shape", t.shape},
                          {"data_offsets", {offset, offset + t.bytes.size()}}};
        offset += t.bytes.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
    std::byte length[8];
    for (int i = 0; i < 8; ++i) length[i] = std::byte((text.size() >> (8 * i)) & 0xff);

    const std::string where = " (writing checkpoint " + path.string() + ")";
    static std::atomic<std::uint64_t> sequence{0};
    std::filesystem::path tmp;
    detail::FileDescriptor file;
    for (int attempt = 0; !file.is_open(); ++attempt) {
        tmp = path.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(sequence.fetch_add(1));
        file = detail::FileDescriptor(tmp, O_WRONLY | O_CREAT | O_EXCL);
        if (!file.is_open() && (errno != EEXIST || attempt > 100))
            throw CheckpointError("gradsync: cannot create " + tmp.string() + ": " + detail::errno_text());
    }
    std::size_t written = 0;
    auto put = [&](const void* data, std::size_t n) {
        auto* p = static_cast<const char*>(data);
        while (n > 0) {
            const auto w = ::write(file.fd(), p, std::min<std::size_t>(n, std::size_t{1} << 30));
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) throw CheckpointError("gradsync: write failed: " + detail::errno_text() + where);
            p += w;
            n -= static_cast<std::size_t>(w);
            written += static_cast<std::size_t>(w);
            if (options.on_write) options.on_write(written);
        }
    };
    try {
        put(length, 8);
        put(text.data(), text.size());
        for (const auto& t : tensors) put(t.bytes.data(), t.bytes.size());
        if (::fsync(file.fd()) != 0) throw CheckpointError("gradsync: fsync failed: " + detail::errno_text() + where);
        if (!file.close()) throw CheckpointError("gradsync: close failed: " + detail::errno_text() + where);
        if (std::rename(tmp.c_str(), path.c_str()) != 0)
            throw CheckpointError("gradsync: cannot rename " + tmp.string() + ": " + detail::errno_text() + where);
    } catch (...) {
        std::error_code ignored;
        std::filesystem::remove(tmp, ignored);
        throw;
    }
    // The rename is durable once the directory is.
    auto dir = path.parent_path();
    detail::FileDescriptor directory(dir.empty() ? std::filesystem::path(".") : dir, O_RDONLY | O_DIRECTORY);
    if (!directory.is_open() || ::fsync(directory.fd()) != 0)
        throw CheckpointError("gradsync: fsync of the directory failed: " + detail::errno_text() + where);
}

}  // namespace gradsync::inline v0

#include <gradsync/checkpoint/safetensors_file.hpp>  // the reader
