// An environment for the tests of code that reads launcher variables through an EnvLookup, so
// that they need not touch the process's own.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace fake_env {

inline std::map<std::string, std::string> variables;

inline std::optional<std::string> lookup(const char* name) {
    auto it = variables.find(name);
    if (it == variables.end()) return std::nullopt;
    return it->second;
}

}  // namespace fake_env
