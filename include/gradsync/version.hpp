// The library's version. Every public name lives in the versioned inline namespace
// gradsync::v0, so two versions linked into one program fail to link instead of silently mixing.
#pragma once

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
