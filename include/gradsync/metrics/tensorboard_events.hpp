// TensorBoardEvents: scalars in a TensorBoard event file, the format TensorBoard's own reader
// (tensorboard.backend.event_processing) loads. The file is a sequence of TFRecords (length, its
// masked CRC-32C, the data, its masked CRC-32C), each an `Event` protocol buffer: first the file
// version, then one event per step holding a `Summary` of simple values. Written by hand (three
// message types, a few fields each) so that no protobuf library is needed.
#pragma once

#include <gradsync/error.hpp>
#include <gradsync/metrics/metrics_file.hpp>
#include <gradsync/metrics/step_metrics.hpp>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>  // for std::memcpy, std::strerror
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unistd.h>  // for gethostname, getpid

namespace gradsync::inline v0 {

namespace detail {

// CRC-32C (Castagnoli), as TFRecord frames use it.
inline std::uint32_t crc32c(std::string_view data) {
    static const auto table = [] {
        std::array<std::uint32_t, 256> t{};
        for (std::uint32_t i = 0; i < 256; ++i) {
            std::uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) != 0 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            t[i] = c;
        }
        return t;
    }();
    std::uint32_t crc = 0xFFFFFFFFu;
    for (unsigned char byte : data) crc = table[(crc ^ byte) & 0xFFu] ^ (crc >> 8);
    return crc ^ 0xFFFFFFFFu;
}

// TFRecord's masked CRC: a CRC of data that holds CRCs would otherwise be weak.
inline std::uint32_t masked_crc32c(std::string_view data) {
    const std::uint32_t crc = crc32c(data);
    return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

// Protocol buffer wire format, the pieces an Event needs.
class ProtoWriter {
public:
    void varint(std::uint32_t field, std::uint64_t v) {
        key(field, 0);
        raw_varint(v);
    }
    void float64(std::uint32_t field, double v) {
        key(field, 1);
        little_endian(v);
    }
    void float32(std::uint32_t field, float v) {
        key(field, 5);
        little_endian(v);
    }
    void bytes(std::uint32_t field, std::string_view v) {
        key(field, 2);
        raw_varint(v.size());
        out_.append(v);
    }
    [[nodiscard]] const std::string& data() const { return out_; }

private:
    void key(std::uint32_t field, std::uint32_t wire_type) { raw_varint((std::uint64_t{field} << 3) | wire_type); }
    void raw_varint(std::uint64_t v) {
        while (v >= 0x80) {
            out_ += static_cast<char>((v & 0x7F) | 0x80);
            v >>= 7;
        }
        out_ += static_cast<char>(v);
    }
    template <class T>
    void little_endian(T v) {  // the hosts gradsync runs on are little-endian, as the format is
        char bytes[sizeof(T)];
        std::memcpy(bytes, &v, sizeof(T));
        out_.append(bytes, sizeof(T));
    }
    std::string out_;
};

}  // namespace detail

class TensorBoardEvents {
public:
    // Creates `directory` (and its parents) and a new event file in it, named as TensorBoard's
    // writers name theirs (events.out.tfevents.<seconds>.<host>.<pid>.gradsync); throws Error
    // naming the path when it cannot.
    explicit TensorBoardEvents(const std::string& directory) {
        std::error_code ec;
        std::filesystem::create_directories(directory, ec);
        if (ec) throw Error("gradsync: cannot make the TensorBoard log directory '" + directory + "': " + ec.message());
        char host[256] = "host";
        (void)gethostname(host, sizeof host - 1);
        const auto now = std::chrono::system_clock::now().time_since_epoch();
        path_ =
            (std::filesystem::path(directory) /
             ("events.out.tfevents." + std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count()) +
              "." + host + "." + std::to_string(getpid()) + ".gradsync"))
                .string();
        file_ = detail::open_metrics_file(path_, "wb", "TensorBoard event file");
        detail::ProtoWriter event;
        event.float64(1, wall_time());
        event.bytes(3, "brain.Event:2");  // file_version
        if (!record(event.data()))
            throw Error("gradsync: cannot write the TensorBoard event file '" + path_ + "': " + std::strerror(errno));
    }

    // One event at `step` holding every value as a scalar tagged by its name. Returns false when
    // the write failed.
    bool write(std::uint64_t step, std::span<const NamedScalar> values) {
        detail::ProtoWriter summary;
        for (const auto& v : values) {
            detail::ProtoWriter value;  // Summary.Value: tag = 1, simple_value = 2
            value.bytes(1, v.name);
            value.float32(2, static_cast<float>(v.value));
            summary.bytes(1, value.data());
        }
        detail::ProtoWriter event;  // Event: wall_time = 1, step = 2, summary = 5
        event.float64(1, wall_time());
        event.varint(2, step);
        event.bytes(5, summary.data());
        return record(event.data());
    }

    [[nodiscard]] const std::string& path() const { return path_; }

private:
    static double wall_time() {
        return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    }

    // A TFRecord: length, masked CRC of the length, data, masked CRC of the data; flushed.
    bool record(const std::string& data) {
        const std::uint64_t length = data.size();
        char head[12];
        std::memcpy(head, &length, 8);
        const std::uint32_t head_crc = detail::masked_crc32c(std::string_view(head, 8));
        std::memcpy(head + 8, &head_crc, 4);
        const std::uint32_t data_crc = detail::masked_crc32c(data);
        std::FILE* f = file_.get();
        return std::fwrite(head, 1, sizeof head, f) == sizeof head &&
               std::fwrite(data.data(), 1, data.size(), f) == data.size() && std::fwrite(&data_crc, 1, 4, f) == 4 &&
               std::fflush(f) == 0;
    }

    std::string path_;
    detail::MetricsFile file_;
};

}  // namespace gradsync::inline v0
