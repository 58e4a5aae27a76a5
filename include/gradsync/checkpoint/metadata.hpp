// What a checkpoint's main file says besides its tensors: the step, the world size, the loss
// scaler's and the sampler's state, as metadata text; and the check that a file holds exactly the
// tensors a load wants.
#pragma once

#include <gradsync/checkpoint/safetensors_file.hpp>
#include <gradsync/detail/number_text.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/launch/sampler.hpp>
#include <gradsync/model/model.hpp>

#include <charconv>  // for std::from_chars
#include <cstddef>
#include <cmath>  // for std::isfinite
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <system_error>  // for std::errc
#include <utility>       // for std::pair
#include <vector>

namespace gradsync::inline v0::detail {

// Fixed-size, so that it can be broadcast as bytes.
struct CheckpointScalars {
    std::uint64_t step = 0;
    std::uint64_t epoch = 0;
    std::uint64_t seed = 0;
    float scale = 0;
    std::uint32_t good_steps = 0;
    std::uint32_t bad_steps = 0;
};

inline std::string metadata_number(std::uint64_t v) { return std::to_string(v); }
inline std::string metadata_number(float v) { return exact_text(v); }  // reads back the same float

// The checkpoint's metadata: the step, the world size, the loss scaler's state, the sampler's.
template <class DP>
std::map<std::string, std::string> checkpoint_metadata(DP& dp, const ShardedSampler* sampler) {
    std::map<std::string, std::string> m{{"format", "pt"},  // what Python loaders expect
                                         {"gradsync.step", metadata_number(dp.steps())},
                                         {"gradsync.world_size", metadata_number(std::uint64_t(dp.world_size()))}};
    if constexpr (requires { dp.loss_scaler().state; }) {
        const auto& s = dp.loss_scaler().state;
        // The scale in use: a scaler that has not stepped yet holds 0 for "the initial scale".
        m["gradsync.loss_scale"] = metadata_number(dp.loss_scaler().scale());
        m["gradsync.good_steps"] = metadata_number(std::uint64_t(s.good_steps));
        m["gradsync.bad_steps"] = metadata_number(std::uint64_t(s.bad_steps));
    }
    if (sampler != nullptr) {
        m["gradsync.sampler.epoch"] = metadata_number(sampler->epoch());
        m["gradsync.sampler.seed"] = metadata_number(sampler->options().seed);
    }
    return m;
}

// The shape a tensor is saved with: the one its model states (a single element that states none
// is 0-d, as a framework's scalar is), else 1-D.
inline std::vector<std::uint64_t> saved_shape(const std::vector<std::size_t>& shape, std::size_t count) {
    if (shape_elements(shape) == count && (!shape.empty() || count == 1)) return {shape.begin(), shape.end()};
    return {count};
}

// Empty when `file` holds exactly the tensors wanted (each with name, count, dtype and shape), with
// their dtypes and sizes, and the shapes the model states (or 1-D: files of earlier versions).
template <class Tensor>
std::string check_contents(const SafetensorsFile& file, const std::vector<Tensor>& wanted) {
    const std::string where = "gradsync: checkpoint " + file.path().string() + " does not fit: ";
    std::set<std::string> names;
    for (const auto& t : wanted) {
        names.insert(t.name);
        const auto* saved = file.find(t.name);
        if (saved == nullptr) return where + "it has no tensor '" + t.name + "'";
        if (saved->dtype != t.dtype)
            return where + "tensor '" + t.name + "' is " + to_string(saved->dtype) + " there and " +
                   to_string(t.dtype) + " here";
        if (saved->bytes.size() != t.count * size_of(t.dtype))
            return where + "tensor '" + t.name + "' has " + std::to_string(saved->bytes.size() / size_of(t.dtype)) +
                   " elements there and " + std::to_string(t.count) + " here";
        const std::vector<std::size_t> there(saved->shape.begin(), saved->shape.end());
        if (!t.shape.empty() && there != t.shape && there != std::vector<std::size_t>{t.count})
            return where + "tensor '" + t.name + "' has shape " + shape_text(there) + " there and " +
                   shape_text(t.shape) + " here";
    }
    for (const auto& saved : file.tensors())
        if (!names.contains(saved.name))
            return where + "it holds tensor '" + saved.name + "', which nothing here loads";
    return {};
}

// The scalars of `file`'s metadata (the sampler's where `with_sampler`); empty or the problem.
inline std::string read_scalars(const SafetensorsFile& file, CheckpointScalars& s, bool with_sampler) {
    const auto& m = file.metadata();
    const std::string where = "gradsync: checkpoint " + file.path().string() + ": metadata '";
    std::string problem;
    auto get = [&](const std::string& key, auto& out) {
        auto it = m.find(key);
        if (it == m.end()) {
            if (problem.empty())
                problem = "gradsync: checkpoint " + file.path().string() + " lacks metadata '" + key + "'" +
                          (key == "gradsync.step" ? " (a file of weights alone, such as a state dict Python saved, "
                                                    "loads with Checkpoint::load_weights)"
                                                  : "");
            return;
        }
        const auto& text = it->second;
        auto r = std::from_chars(text.data(), text.data() + text.size(), out);
        if ((r.ec != std::errc{} || r.ptr != text.data() + text.size()) && problem.empty())
            problem = where + key + "' = '" + excerpt(text) + "' is not a number in range";
    };
    get("gradsync.step", s.step);
    if (m.contains("gradsync.loss_scale")) {
        get("gradsync.loss_scale", s.scale);
        if (problem.empty() && !(std::isfinite(s.scale) && s.scale > 0))
            problem = where + "gradsync.loss_scale' = '" + excerpt(m.at("gradsync.loss_scale")) +
                      "' is not a finite scale above 0";
        std::uint64_t good = 0, bad = 0;
        get("gradsync.good_steps", good);
        get("gradsync.bad_steps", bad);
        for (auto [key, v] : {std::pair{"gradsync.good_steps", good}, std::pair{"gradsync.bad_steps", bad}})
            if (problem.empty() && v > std::numeric_limits<std::uint32_t>::max())
                problem = where + std::string(key) + "' = " + std::to_string(v) + " is out of range";
        s.good_steps = static_cast<std::uint32_t>(good);
        s.bad_steps = static_cast<std::uint32_t>(bad);
    }
    if (with_sampler) {
        get("gradsync.sampler.epoch", s.epoch);
        get("gradsync.sampler.seed", s.seed);
    }
    return problem;
}

}  // namespace gradsync::inline v0::detail
