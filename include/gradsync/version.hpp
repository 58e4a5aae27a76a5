// The library's version. Every public name lives in the versioned inline namespace
// gradsync::v0, so two versions linked into one program fail to link instead of silently mixing.
#pragma once

// Every gradsync header includes this one before any code of its own, so an older standard stops
// here, with one clear error, instead of at the first concept. (The second include ends the
// compilation: GCC and Clang go on after #error.)
#if __cplusplus < 202002L && !(defined(_MSVC_LANG) && _MSVC_LANG >= 202002L)
#error \
    "gradsync needs C++20: compile with -std=c++20 (CMake: link gradsync::gradsync, which requires cxx_std_20, or set CMAKE_CXX_STANDARD 20)"
#include <gradsync_needs_cxx20>
#endif

#define GRADSYNC_VERSION_MAJOR 0
#define GRADSYNC_VERSION_MINOR 1
#define GRADSYNC_VERSION_PATCH 0

namespace gradsync::inline v0 {

struct Version {
    int major;
    int minor;
    int patch;
};

inline constexpr Version version{GRADSYNC_VERSION_MAJOR, GRADSYNC_VERSION_MINOR, GRADSYNC_VERSION_PATCH};

}  // namespace gradsync::inline v0
