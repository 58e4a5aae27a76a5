// A Chrome trace of the buckets' lives (open in ui.perfetto.dev or chrome://tracing). Ranks of
// one process writing to the same path share one sink, so their events land in one file on one
// clock; the file is written when the last of them is done.
#pragma once

#include <gradsync/error.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>  // for std::getenv
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace gradsync::inline v0::detail {

class TimelineSink {
public:
    explicit TimelineSink(std::string path) : path_(std::move(path)), origin_(std::chrono::steady_clock::now()) {}
    TimelineSink(const TimelineSink&) = delete;
    TimelineSink& operator=(const TimelineSink&) = delete;
    ~TimelineSink() { write(); }

    // The sink of `path`, shared with every other user of the same path in this process.
    static std::shared_ptr<TimelineSink> open(const std::string& path) {
        static std::mutex mutex;
        static std::map<std::string, std::weak_ptr<TimelineSink>> sinks;
        std::lock_guard lock(mutex);
        auto& slot = sinks[path];
        auto sink = slot.lock();
        if (!sink) {
            sink = std::make_shared<TimelineSink>(path);
            slot = sink;
        }
        return sink;
    }

    [[nodiscard]] double micros(std::chrono::steady_clock::time_point t) const {
        return std::chrono::duration<double, std::micro>(t - origin_).count();
    }

    void add(std::string event) {
        std::lock_guard lock(mutex_);
        events_.push_back(std::move(event));
    }

    // Writes every event so far; also done at destruction.
    void write() {
        std::lock_guard lock(mutex_);
        std::FILE* f = std::fopen(path_.c_str(), "w");
        if (f == nullptr) return;  // a trace is a diagnostic aid: never fail the training for it
        std::fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n", f);
        for (std::size_t i = 0; i < events_.size(); ++i) {
            std::fputs(events_[i].c_str(), f);
            std::fputs(i + 1 < events_.size() ? ",\n" : "\n", f);
        }
        std::fputs("]}\n", f);
        std::fclose(f);
    }

private:
    std::string path_;
    std::chrono::steady_clock::time_point origin_;
    std::mutex mutex_;
    std::vector<std::string> events_;
};

// One rank's view of a sink: the rank is the process id; thread 0 holds the steps, thread b + 1
// bucket b.
class Timeline {
public:
    Timeline() = default;
    Timeline(const std::string& path_pattern, int rank) : rank_(rank) {
        if (path_pattern.empty()) return;
        std::string path = path_pattern;
        if (auto at = path.find("{rank}"); at != std::string::npos) path.replace(at, 6, std::to_string(rank));
        sink_ = TimelineSink::open(path);
        sink_->add(R"({"name":"process_name","ph":"M","pid":)" + std::to_string(rank) + R"(,"args":{"name":"rank )" +
                   std::to_string(rank) + R"("}})");
    }

    [[nodiscard]] bool enabled() const { return sink_ != nullptr; }

    // A moment: "ready" or "launched" of a bucket in a step.
    void instant(const char* name, std::int64_t step, int bucket, std::chrono::steady_clock::time_point t) {
        if (!sink_) return;
        sink_->add(std::string(R"({"name":")") + name + R"(","ph":"i","s":"t","ts":)" + number(sink_->micros(t)) +
                   R"(,"pid":)" + std::to_string(rank_) + R"(,"tid":)" + std::to_string(bucket + 1) +
                   args(step, bucket) + "}");
    }

    // A span: a bucket's allreduce from launch to completion, or a whole step (bucket -1).
    void span(const char* name, std::int64_t step, int bucket, std::chrono::steady_clock::time_point begin,
              std::chrono::steady_clock::time_point end) {
        if (!sink_) return;
        double b = sink_->micros(begin), e = sink_->micros(end);
        sink_->add(std::string(R"({"name":")") + name + R"(","ph":"X","ts":)" + number(b) + R"(,"dur":)" +
                   number(e > b ? e - b : 0.0) + R"(,"pid":)" + std::to_string(rank_) + R"(,"tid":)" +
                   std::to_string(bucket + 1) + args(step, bucket) + "}");
    }

    // A remark on the steps' row, e.g. the plan bucket tuning chose (text without quotes).
    void note(const char* name, std::int64_t step, const std::string& text) {
        if (!sink_) return;
        sink_->add(std::string(R"({"name":")") + name + R"(","ph":"i","s":"p","ts":)" +
                   number(sink_->micros(std::chrono::steady_clock::now())) + R"(,"pid":)" + std::to_string(rank_) +
                   R"(,"tid":0,"args":{"step":)" + std::to_string(step) + R"(,"text":")" + text + R"("}})");
    }

private:
    static std::string number(double v) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.3f", v);
        return buf;
    }
    static std::string args(std::int64_t step, int bucket) {
        return R"(,"args":{"step":)" + std::to_string(step) + R"(,"bucket":)" + std::to_string(bucket) + "}";
    }

    std::shared_ptr<TimelineSink> sink_;
    int rank_ = 0;
};

// One step's events: each bucket's allreduce (launched to done), and, when backward launched
// them, the moments its last gradient was ready and it was launched; then the step itself.
// `slots` are the bucket engine's; completed_at(b) is when bucket b's last gradient was ready.
template <class Slots, class CompletedAt>
void record_step(Timeline& timeline, std::int64_t step, const Slots& slots, bool overlapped, CompletedAt&& completed_at,
                 std::chrono::steady_clock::time_point began) {
    if (!timeline.enabled()) return;
    for (std::size_t b = 0; b < slots.size(); ++b) {
        const auto& slot = slots[b];
        if (slot.finished_at == std::chrono::steady_clock::time_point{}) continue;  // not timed (the device's)
        if (overlapped) {
            timeline.instant("ready", step, static_cast<int>(b), completed_at(b));
            timeline.instant("launched", step, static_cast<int>(b), slot.launched_at);
        }
        timeline.span("allreduce", step, static_cast<int>(b), slot.launched_at, slot.finished_at);
    }
    timeline.span("step", step, -1, began, std::chrono::steady_clock::now());
}

// Where the timeline goes: Options::timeline, or $GRADSYNC_TIMELINE when that is empty.
inline std::string timeline_path(const std::string& from_options) {
    if (!from_options.empty()) return from_options;
    const char* env = std::getenv("GRADSYNC_TIMELINE");
    return env != nullptr ? env : "";
}

}  // namespace gradsync::inline v0::detail
