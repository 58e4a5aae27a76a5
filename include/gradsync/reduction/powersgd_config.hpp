// What PowerSGD on the host (reduction/powersgd.hpp) and on the device
// (reduction/powersgd_cuda.cuh) share: the configuration and its agreed text, which parameters
// are compressed and at what rank, and the first Q each matrix starts from (the same draw on the
// host and in a kernel).
#pragma once

#include <gradsync/detail/host_device.hpp>
#include <gradsync/detail/number_text.hpp>
#include <gradsync/reduction/comm_hook.hpp>

#include <algorithm>  // for std::min
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace gradsync::inline v0 {

struct PowerSGDConfig {
    std::size_t rank = 1;        // of the approximation
    bool error_feedback = true;  // carry what was left out into the next step
    bool warm_start = true;      // start from the last step's Q
    std::uint64_t seed = 0;      // of the first Q (and every Q without warm start)
    // A matrix is compressed only where that divides its values by at least this much
    // (n m >= rate (n + m) r); 0 compresses every matrix.
    double min_compression_rate = 2.0;
};

// What carries over from step to step, for one matrix: the error (n x m, unscaled: the loss scale
// may change between steps) and the last Q, transposed (r x m).
struct PowerSGDState {
    std::vector<float> error;
    std::vector<float> q;
};

// Where one matrix's state lies, for a checkpoint: in host memory (PowerSGD) or device memory
// (CudaPowerSGD). Empty where the configuration keeps none (no error feedback, no warm start).
struct PowerSGDArrays {
    std::span<float> error;
    std::span<float> q;
};

namespace detail {

// The text the ranks agree on: the same on the host and on the device.
inline std::string powersgd_settings(const PowerSGDConfig& c) {
    return "PowerSGD rank " + std::to_string(c.rank) + ", error feedback " + (c.error_feedback ? "on" : "off") +
           ", warm start " + (c.warm_start ? "on" : "off") + ", seed " + std::to_string(c.seed) +
           ", min compression rate " + exact_text(c.min_compression_rate);
}
inline std::string powersgd_invalid(const PowerSGDConfig& c) {
    if (c.rank == 0) return "PowerSGD's rank must be at least 1";
    if (!(c.min_compression_rate >= 0)) return "PowerSGD's min_compression_rate must be at least 0";
    return {};
}

// A parameter compressed as the n x m matrix (its first dimension by the rest) at rank r.
struct LowRankShape {
    std::size_t n, m, r;
};

// The matrix a parameter is compressed as, or none: vectors, parameters without a shape and
// matrices whose factors would be no smaller are averaged exactly.
inline std::optional<LowRankShape> powersgd_shape(const PowerSGDConfig& c, const HookParameter& p) {
    if (p.shape.size() < 2 || p.shape[0] == 0) return std::nullopt;
    const std::size_t n = p.shape[0], m = p.count / n;
    const std::size_t r = std::min({c.rank, n, m});
    if (static_cast<double>(n) * static_cast<double>(m) < c.min_compression_rate * static_cast<double>((n + m) * r))
        return std::nullopt;
    return LowRankShape{n, m, r};
}

// The key of a matrix's first Q: the seed and a byte-wise FNV-1a of its name (with this basis:
// the tests' tolerances were measured with it); without warm start, the step too, so that each
// step draws afresh.
inline std::uint64_t powersgd_key(const PowerSGDConfig& c, const std::string& name) {
    std::uint64_t h = 1469598103934665603ull;
    for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
    return c.seed ^ h;
}
inline std::uint64_t powersgd_step_key(const PowerSGDConfig& c, std::int64_t step) {
    return c.warm_start ? 0 : static_cast<std::uint64_t>(step) * 0x9e3779b97f4a7c15ull;
}

// Element i of the Q drawn from `key`: in [-1, 1), the same on every rank, host or device.
GRADSYNC_HOST_DEVICE inline float powersgd_uniform(std::uint64_t key, std::uint64_t i) {
    std::uint64_t x = key + i + 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

}  // namespace detail

}  // namespace gradsync::inline v0
