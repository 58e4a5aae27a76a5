// The file a metrics writer appends its records to: opened with an error that names it, closed
// when the writer goes.
#pragma once

#include <gradsync/error.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>  // for std::strerror
#include <memory>
#include <string>

namespace gradsync::inline v0::detail {

struct CloseFile {
    void operator()(std::FILE* f) const { std::fclose(f); }
};
using MetricsFile = std::unique_ptr<std::FILE, CloseFile>;

// Opens `path` with fopen's `mode`; throws Error naming `what` and the path when it cannot.
inline MetricsFile open_metrics_file(const std::string& path, const char* mode, const char* what) {
    MetricsFile file(std::fopen(path.c_str(), mode));
    if (!file)
        throw Error(std::string("gradsync: cannot open the ") + what + " '" + path + "': " + std::strerror(errno));
    return file;
}

}  // namespace gradsync::inline v0::detail
