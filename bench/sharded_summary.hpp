// The sharded part of the summary: reduce-scatter + all-gather against the allreduce,
// ShardedDataParallel's step and state against DataParallel's, stage 2 against stage 1, and the
// all-gathers behind the next forward.
#pragma once

#include "summary_table.hpp"

#include <string>

namespace bench {

inline void sharded_rows() {
    // Sharded data parallel's two halves against the allreduce: the same bytes cross.
    for (long long bytes : {1ll << 20, 4ll << 20, 16ll << 20, 64ll << 20, 256ll << 20}) {
        const std::string key = "sharded_vs_allreduce_2_ranks/bytes:" + std::to_string(bytes);
        auto s = counter(key, "sharded_us"), a = counter(key, "allreduce_us"),
             r = counter(key, "sharded_over_allreduce");
        if (!s || !a || !r) {
            if (!quick_mode || bytes == (1ll << 20)) missing(key);
            continue;
        }
        target_row("reduce_scatter + all_gather / allreduce, " + size_name(bytes), shown("%.1f", *s, "us"),
                   shown("%.1f", *a, "us", "allreduce"), *r, "<= 1.10", *r <= 1.10);
    }
    // ShardedDataParallel's step against DataParallel's, and the optimizer state each keeps.
    for (const char* layout : {"resnet50", "bert_base"}) {
        const std::string key = std::string("sharded_step/") + layout;
        auto sh = counter(key, "sharded_ms"), un = counter(key, "unsharded_ms"), r = counter(key, "ratio");
        auto st = counter(key, "state_bytes_sharded"), su = counter(key, "state_bytes_unsharded");
        if (!sh || !un || !r || !st || !su) {
            missing(key);
            continue;
        }
        const std::string name = layout_title(layout);
        target_row("sharded step / DataParallel step, " + name, shown("%.2f", *sh, "ms"),
                   shown("%.2f", *un, "ms", "unsharded"), *r, "<= 1.10", *r <= 1.10);
        target_row("optimizer state per rank, sharded / unsharded, " + name,
                   shown_bytes(gradsync::Bytes{static_cast<std::uint64_t>(*st)}),
                   shown_bytes(gradsync::Bytes{static_cast<std::uint64_t>(*su)}, "unsharded"), *st / *su, "<= 0.51",
                   *st / *su <= 0.51);
    }
    // Stage 2 against stage 1: the gradient memory a rank holds at its peak, and the step; over a
    // backend that reduces in place and over one that reduces packed copies.
    for (const std::string layout : {"resnet50", "bert_base", "resnet50/packed", "bert_base/packed"}) {
        const std::string key = "released_gradients/" + layout;
        auto re = counter(key, "released_ms"), ke = counter(key, "kept_ms"), r = counter(key, "ratio");
        auto pr = counter(key, "peak_grad_bytes_released"), pk = counter(key, "peak_grad_bytes_kept");
        if (!re || !ke || !r || !pr || !pk) {
            missing(key);
            continue;
        }
        const std::string name = layout_title(layout) + (layout.ends_with("/packed") ? ", packed copies" : "");
        target_row("peak gradient memory per rank, released / kept, " + name,
                   shown_bytes(gradsync::Bytes{static_cast<std::uint64_t>(*pr)}),
                   shown_bytes(gradsync::Bytes{static_cast<std::uint64_t>(*pk)}, "kept"), *pr / *pk, "-", true);
        target_row("backward + step, released / kept gradients, " + name, shown("%.2f", *re, "ms"),
                   shown("%.2f", *ke, "ms", "kept"), *r, "-", true);
    }
    // The all-gathers behind the next forward: what the forward's compute did not hide of them.
    for (const char* layout : {"resnet50", "bert_base"})
        for (const char* ratio : {"0.5", "1"}) {
            const std::string key = std::string("gather_behind_forward/") + layout + "/comm_to_compute:" + ratio;
            auto ex = counter(key, "exposed_ms"), ga = counter(key, "gather_ms"), r = counter(key, "ratio");
            if (!ex || !ga || !r) {
                missing(key);
                continue;
            }
            const std::string name = layout_title(layout);
            const bool headline = std::string(ratio) == "1";  // a forward as long as the gathers
            target_row("exposed all-gather / all-gather, " + name + ", comm/c " + ratio, shown("%.2f", *ex, "ms"),
                       shown("%.2f", *ga, "ms", "all-gather"), *r, headline ? "<= 0.20" : "-", *r <= 0.20);
        }
}

}  // namespace bench
