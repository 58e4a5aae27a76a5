// The metrics policy's writer on a front: rank 0's, which turns each step's report and the
// trainer's own scalars into one record per step.
#pragma once

#include <gradsync/data_parallel/finalize_step.hpp>
#include <gradsync/error.hpp>
#include <gradsync/metrics/json_lines.hpp>
#include <gradsync/metrics/step_metrics.hpp>
#include <gradsync/metrics/tensorboard_events.hpp>

#include <algorithm>  // for std::find_if
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace gradsync::inline v0::detail {

template <class P>
constexpr bool check_metrics_policy() {
    static_assert(std::is_same_v<P, StepMetrics> || std::is_same_v<P, NoMetrics>,
                  "gradsync: the metrics policy is gradsync::StepMetrics{path, format} or gradsync::NoMetrics");
    return true;
}

// A step's record: each field's name and its value in the report (`skipped`: steps skipped so
// far). A trainer's scalar may take none of these names.
struct StepRecordField {
    std::string_view name;
    double (*value)(const StepReport& report, std::uint64_t skipped);
};
inline constexpr StepRecordField step_record[] = {
    {"applied", [](const StepReport& r, std::uint64_t) { return r.applied ? 1.0 : 0.0; }},
    {"loss_scale", [](const StepReport& r, std::uint64_t) { return double{r.loss_scale}; }},
    {"next_loss_scale", [](const StepReport& r, std::uint64_t) { return double{r.next_loss_scale}; }},
    {"skipped_steps", [](const StepReport&, std::uint64_t skipped) { return static_cast<double>(skipped); }},
    {"grad_norm", [](const StepReport& r, std::uint64_t) { return double{r.grad_norm}; }},
    {"clipped", [](const StepReport& r, std::uint64_t) { return r.clipped ? 1.0 : 0.0; }},
    {"learning_rate", [](const StepReport& r, std::uint64_t) { return double{r.learning_rate}; }},
    {"overflowed", [](const StepReport& r, std::uint64_t) { return static_cast<double>(r.overflowed.size()); }},
    {"step_seconds", [](const StepReport& r, std::uint64_t) { return r.step_seconds; }},
    {"sync_seconds", [](const StepReport& r, std::uint64_t) { return r.sync_seconds; }},
    {"bytes_reduced", [](const StepReport& r, std::uint64_t) { return static_cast<double>(r.bytes_reduced); }},
};

// The trainer's scalar name: not empty, none of the record's own.
inline void check_scalar_name(std::string_view name) {
    if (name.empty()) throw Error("gradsync: add_scalar needs a name");
    for (const auto& own : step_record)
        if (name == own.name)
            throw Error("gradsync: add_scalar(\"" + std::string(name) +
                        "\"): that name is one step() itself records; choose another");
}

// Rank 0's writer of the metrics policy (nothing on the other ranks, nothing at all for
// NoMetrics). A file that cannot be opened is a problem of the set-up, refused by every rank; a
// write that fails later is reported once on stderr and training goes on.
template <class Policy>
class StepMetricsLog {
public:
    StepMetricsLog() = default;
    StepMetricsLog(const Policy& policy, int rank) {
        if constexpr (Policy::on) {
            problem_ = policy.invalid();
            if (!problem_.empty() || rank != 0) return;
            try {
                if (policy.format == MetricsFormat::tensorboard)
                    tensorboard_.emplace(policy.path);
                else
                    json_.emplace(policy.path);
            } catch (const Error& e) {
                problem_ = e.what();
            }
        } else {
            (void)policy;
            (void)rank;
        }
    }

    // What keeps the policy from working here, or "".
    [[nodiscard]] const std::string& problem() const { return problem_; }
    // The file written to: rank 0's, or "" on the other ranks.
    [[nodiscard]] std::string path() const {
        if (json_) return json_->path();
        if (tensorboard_) return tensorboard_->path();
        return {};
    }

    // A scalar of the trainer's own (the loss, say), written with the next step's record.
    void add(std::string_view name, double value) {
        check_scalar_name(name);
        if (!writing()) return;
        auto same = std::find_if(added_.begin(), added_.end(), [&](const NamedScalar& s) { return s.name == name; });
        if (same != added_.end())
            same->value = value;
        else
            added_.push_back({std::string(name), value});
    }

    void write(const StepReport& report) {
        if constexpr (Policy::on) {
            if (!writing()) return;
            if (!report.applied) ++skipped_;
            std::vector<NamedScalar> values;
            for (const auto& field : step_record)
                values.push_back({std::string(field.name), field.value(report, skipped_)});
            values.insert(values.end(), added_.begin(), added_.end());
            added_.clear();
            const bool written = json_ ? json_->write(report.step, values) : tensorboard_->write(report.step, values);
            if (!written) {
                std::fprintf(stderr,
                             "gradsync: rank 0: the metrics of step %llu could not be written to '%s'; "
                             "training goes on without them\n",
                             static_cast<unsigned long long>(report.step), path().c_str());
                json_.reset();
                tensorboard_.reset();
            }
        } else {
            (void)report;
        }
    }

private:
    [[nodiscard]] bool writing() const { return json_.has_value() || tensorboard_.has_value(); }

    std::string problem_;
    std::optional<JsonLinesFile> json_;
    std::optional<TensorBoardEvents> tensorboard_;
    std::vector<NamedScalar> added_;
    std::uint64_t skipped_ = 0;
};

}  // namespace gradsync::inline v0::detail
