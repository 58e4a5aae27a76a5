// The training scalars' part of the summary: what a step()'s report adds with metrics off (the
// default), what writing JSON lines or TensorBoard events adds, and step() beside synchronize()
// and the optimizer (its finalize pass measures the norm).
#pragma once

#include "summary_table.hpp"

namespace bench {

inline void metrics_rows() {
    const char* key = "metrics_cost/small_model";
    auto plain = counter(key, "plain_us"), off = counter(key, "off_us"), json = counter(key, "json_us"),
         tb = counter(key, "tensorboard_us"), added = counter(key, "added_ns");
    if (!plain || !off || !json || !tb || !added) {
        missing(key);
        return;
    }
    const double share = *added * 1e-3 / *off;
    target_row("metrics off: the report's own work / step()", shown("%.0f", *added, "ns"),
               shown("%.1f", *off, "us", "step"), share, "<= 0.01", share <= 0.01);
    target_row("step(), JSON lines / metrics off", shown("%.1f", *json, "us"), shown("%.1f", *off, "us", "off"),
               *json / *off, "-", true);
    target_row("step(), TensorBoard / metrics off", shown("%.1f", *tb, "us"), shown("%.1f", *off, "us", "off"),
               *tb / *off, "-", true);
    target_row("step() / synchronize() + optimizer (finalize pass)", shown("%.1f", *off, "us"),
               shown("%.1f", *plain, "us", "plain"), *off / *plain, "-", true);
}

}  // namespace bench
