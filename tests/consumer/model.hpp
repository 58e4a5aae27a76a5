// The smallest model a consumer wraps: one parameter of three floats.
#pragma once

#include <gradsync/model/model.hpp>

#include <vector>

struct Model {
    std::vector<float> w = std::vector<float>(3), g = std::vector<float>(3);
    std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
};
