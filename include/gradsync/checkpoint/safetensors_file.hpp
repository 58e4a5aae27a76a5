// SafetensorsFile: a safetensors file read whole and checked, as something that may have been
// damaged or written by anyone: only a regular file is opened (a directory, FIFO or device is
// refused without reading), the header has a size cap and a nesting cap, shapes and offsets are
// checked for overflow, and messages quote the file's contents only in short, printable excerpts.
// Every problem is a CheckpointError naming the file.
#pragma once

#include <gradsync/checkpoint/safetensors.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/error.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>  // for std::sort
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <string>
#include <system_error>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0 {

namespace detail {

// At most `limit` characters of `text`, non-printable ones as '?', for a message.
inline std::string excerpt(const std::string& text, std::size_t limit = 64) {
    std::string out;
    for (std::size_t i = 0; i < text.size() && i < limit; ++i) {
        const auto c = static_cast<unsigned char>(text[i]);
        out += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
    }
    if (text.size() > limit) out += "... (" + std::to_string(text.size()) + " characters)";
    return out;
}

// A JSON value in a message: its kind, and a short excerpt of scalars only.
inline std::string describe_json(const nlohmann::json& v) {
    if (v.is_object()) return "an object";
    if (v.is_array()) return "a list of " + std::to_string(v.size());
    if (v.is_string()) return "\"" + excerpt(v.get<std::string>()) + "\"";
    return excerpt(v.dump());  // a number, a boolean or null: short
}

}  // namespace detail

class SafetensorsFile {
public:
    static constexpr std::uint64_t max_header_bytes = 100'000'000;  // as safetensors' own reader
    static constexpr int max_header_depth = 8;                      // a valid header needs 3

    explicit SafetensorsFile(const std::filesystem::path& path) : path_(path) {
        std::error_code ec;
        const auto status = std::filesystem::status(path, ec);
        if (ec || !std::filesystem::exists(status)) throw error("cannot open it");
        if (!std::filesystem::is_regular_file(status))
            throw error(std::filesystem::is_directory(status) ? "it is a directory" : "it is not a regular file");
        std::ifstream in(path, std::ios::binary);
        if (!in) throw error("cannot open it");
        in.seekg(0, std::ios::end);
        const auto end = in.tellg();
        if (end < 0) throw error("its size cannot be read");
        std::vector<std::byte> bytes(static_cast<std::size_t>(end));
        in.seekg(0);
        in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
        if (!in) throw error("reading it failed");
        load(std::move(bytes));
    }

    // The same checks over bytes in memory; `name` stands for the path in messages.
    SafetensorsFile(std::filesystem::path name, std::vector<std::byte> bytes) : path_(std::move(name)) {
        load(std::move(bytes));
    }

    [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }
    [[nodiscard]] const std::vector<TensorBytes>& tensors() const { return tensors_; }
    [[nodiscard]] const TensorBytes* find(const std::string& name) const {
        for (const auto& t : tensors_)
            if (t.name == name) return &t;
        return nullptr;
    }
    [[nodiscard]] const std::filesystem::path& path() const { return path_; }

private:
    CheckpointError error(const std::string& what) const {
        return CheckpointError("gradsync: checkpoint " + path_.string() + " is unreadable: " + what);
    }

    void load(std::vector<std::byte> bytes) {
        const std::uint64_t size = bytes.size();
        if (size < 8) throw error("it has " + std::to_string(size) + " bytes, fewer than a header length needs");
        std::uint64_t length = 0;
        for (int i = 0; i < 8; ++i)
            length |= std::uint64_t(std::to_integer<unsigned char>(bytes[std::size_t(i)])) << (8 * i);
        if (length > size - 8)
            throw error("its header claims " + std::to_string(length) + " bytes but only " + std::to_string(size - 8) +
                        " follow (truncated or not a safetensors file)");
        if (length > max_header_bytes)
            throw error("its header claims " + std::to_string(length) + " bytes, more than the " +
                        std::to_string(max_header_bytes) + " a safetensors header may have");
        const std::string text(reinterpret_cast<const char*>(bytes.data()) + 8, static_cast<std::size_t>(length));
        data_.assign(bytes.begin() + static_cast<std::ptrdiff_t>(8 + length), bytes.end());
        parse(text);
    }

    void parse(const std::string& text) {
        nlohmann::json header;
        try {
            // A depth cap, so that no nesting can exhaust the stack of what walks the value.
            header = nlohmann::json::parse(text, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
                if (depth > max_header_depth)
                    throw std::length_error("nested deeper than " + std::to_string(max_header_depth) + " levels");
                return true;
            });
        } catch (const nlohmann::json::exception& e) {
            throw error("its header is not JSON (" + detail::excerpt(e.what(), 200) + ")");
        } catch (const std::length_error& e) {
            throw error(std::string("its header is ") + e.what());
        }
        if (!header.is_object()) throw error("its header is not a JSON object");
        struct Range {
            std::uint64_t begin, end;
            std::string name;
        };
        std::vector<Range> ranges;
        for (const auto& [name, entry] : header.items()) {
            if (name == "__metadata__") {
                if (!entry.is_object())
                    throw error("__metadata__ is " + detail::describe_json(entry) + ", not an object");
                for (const auto& [k, v] : entry.items()) {
                    if (!v.is_string())
                        throw error("__metadata__ entry '" + detail::excerpt(k) + "' is " + detail::describe_json(v) +
                                    ", not a string");
                    metadata_[k] = v.get<std::string>();
                }
                continue;
            }
            const std::string what = "tensor '" + detail::excerpt(name) + "' ";
            if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
                !entry.contains("data_offsets"))
                throw error(what + "lacks dtype, shape or data_offsets");
            const auto& d = entry["dtype"];
            auto dtype = d.is_string() ? detail::dtype_from_safetensors(d.get<std::string>()) : std::nullopt;
            if (!dtype) throw error(what + "has dtype " + detail::describe_json(d) + ", not one gradsync knows");
            std::vector<std::uint64_t> shape;
            std::uint64_t bytes = size_of(*dtype);
            if (!entry["shape"].is_array()) throw error(what + "has a shape that is not a list");
            for (const auto& dim : entry["shape"]) {
                if (!dim.is_number_unsigned())
                    throw error(what + "has a shape entry " + detail::describe_json(dim) + ", not a whole number");
                shape.push_back(dim.get<std::uint64_t>());
                if (__builtin_mul_overflow(bytes, shape.back(), &bytes))
                    throw error(what + "has a shape whose size overflows 64 bits");
            }
            const auto& off = entry["data_offsets"];
            if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
                throw error(what + "has data_offsets " + detail::describe_json(off) + ", not [begin, end]");
            const auto begin = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
            if (begin > end || end > data_.size())
                throw error(what + "has bytes [" + std::to_string(begin) + ", " + std::to_string(end) +
                            ") outside the file's " + std::to_string(data_.size()) + " data bytes");
            if (end - begin != bytes)
                throw error(what + "has " + std::to_string(end - begin) + " bytes, but its shape and dtype say " +
                            std::to_string(bytes));
            ranges.push_back({begin, end, name});
            tensors_.push_back(TensorBytes{name, *dtype, std::move(shape),
                                           std::span<const std::byte>(data_.data() + begin, end - begin)});
        }
        std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
        for (std::size_t i = 1; i < ranges.size(); ++i)
            if (ranges[i].begin < ranges[i - 1].end)
                throw error("tensors '" + detail::excerpt(ranges[i - 1].name) + "' and '" +
                            detail::excerpt(ranges[i].name) + "' overlap");
    }

    std::filesystem::path path_;
    std::vector<std::byte> data_;
    std::map<std::string, std::string> metadata_;
    std::vector<TensorBytes> tensors_;
};

}  // namespace gradsync::inline v0
