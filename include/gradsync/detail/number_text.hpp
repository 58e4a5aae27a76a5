// Numbers as text that reads back as the same number: the shortest such text (1e-07, 0.1, 65536),
// so that settings the ranks agree on are compared exactly, and read as a user wrote them.
#pragma once

#include <gradsync/version.hpp>

#include <charconv>  // for std::to_chars
#include <string>

namespace gradsync::inline v0::detail {

inline std::string exact_text(double v) {
    char text[32];
    const auto end = std::to_chars(text, text + sizeof text, v).ptr;
    return std::string(text, end);
}
inline std::string exact_text(float v) {
    char text[32];
    const auto end = std::to_chars(text, text + sizeof text, v).ptr;
    return std::string(text, end);
}

}  // namespace gradsync::inline v0::detail
