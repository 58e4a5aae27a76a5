// JsonLinesFile: records of named numbers, one JSON object per line ({"step":3,"grad_norm":0.41}),
// appended and flushed one by one, so that a reader (pandas.read_json(lines=True), jq) sees every
// step written so far. A value that is not finite is written null (JSON has no infinity or NaN).
#pragma once

#include <gradsync/metrics/metrics_file.hpp>
#include <gradsync/metrics/step_metrics.hpp>

#include <charconv>  // for std::to_chars
#include <cmath>     // for std::isfinite
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>

namespace gradsync::inline v0 {

class JsonLinesFile {
public:
    // Opens `path` to append (creating it); throws Error naming the path when it cannot.
    explicit JsonLinesFile(std::string path)
        : path_(std::move(path)), file_(detail::open_metrics_file(path_, "ab", "metrics file")) {}

    // One line: {"step":step, name:value, ...}. Returns false when the write failed.
    bool write(std::uint64_t step, std::span<const NamedScalar> values) {
        std::string line = "{\"step\":" + std::to_string(step);
        for (const auto& v : values) {
            line += ",\"";
            append_escaped(line, v.name);
            line += "\":";
            append_number(line, v.value);
        }
        line += "}\n";
        return std::fwrite(line.data(), 1, line.size(), file_.get()) == line.size() && std::fflush(file_.get()) == 0;
    }

    [[nodiscard]] const std::string& path() const { return path_; }

private:
    static void append_number(std::string& out, double v) {
        if (!std::isfinite(v)) {
            out += "null";
            return;
        }
        char text[32];
        out.append(text, std::to_chars(text, text + sizeof text, v).ptr);  // the shortest exact form
    }
    static void append_escaped(std::string& out, std::string_view text) {
        for (char c : text) {
            if (c == '"' || c == '\\') {
                out += '\\';
                out += c;
            } else if (static_cast<unsigned char>(c) < 0x20) {
                char code[8];
                std::snprintf(code, sizeof code, "\\u%04x", static_cast<unsigned>(c));
                out += code;
            } else {
                out += c;
            }
        }
    }

    std::string path_;
    detail::MetricsFile file_;
};

}  // namespace gradsync::inline v0
