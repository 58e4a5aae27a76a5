// Training scalars written every step: the policy that asks for them (StepMetrics, or NoMetrics,
// the default), the formats, and a named scalar as the writers take it.
#pragma once

#include <gradsync/detail/policy.hpp>

#include <string>

namespace gradsync::inline v0 {

enum class MetricsFormat : unsigned char {
    json_lines,   // one JSON object per step and line, in the file `path`
    tensorboard,  // TensorBoard event files in the directory `path` (a log dir)
};

// One value of a step's record: "grad_norm", "loss", ...
struct NamedScalar {
    std::string name;
    double value = 0;
};

// Writes every step()'s report (data_parallel/finalize_step.hpp: StepReport) and the scalars the
// trainer added (add_scalar) from rank 0, as JSON lines or TensorBoard events. Other ranks write
// nothing. Written records are flushed at once, so a crashed run keeps its last steps.
struct StepMetrics {
    using policy_category = policy_category::metrics;
    static constexpr bool on = true;

    std::string path;                                  // a file (JSON lines) or a directory (TensorBoard)
    MetricsFormat format = MetricsFormat::json_lines;  // the default

    // Not agreed between ranks (only rank 0 writes, and nothing it writes changes a result).
    [[nodiscard]] std::string settings() const { return "metrics"; }
    [[nodiscard]] std::string invalid() const {
        return path.empty() ? "StepMetrics needs a path: the JSON lines file, or the TensorBoard log directory"
                            : std::string{};
    }
};

// No metrics: nothing is kept or written, and step() costs what it did without them. The default.
struct NoMetrics {
    using policy_category = policy_category::metrics;
    static constexpr bool on = false;
    [[nodiscard]] std::string settings() const { return "none"; }
};

}  // namespace gradsync::inline v0
