// Training scalars: the report's times and bytes, and the metrics policy writing every step's
// record from rank 0 as JSON lines or TensorBoard events (read back here byte by byte; the
// tensorboard.metrics test reads them with TensorBoard's own reader).
#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/metrics/json_lines.hpp>
#include <gradsync/metrics/tensorboard_events.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "support/temp_dir.hpp"
#include "support/toy_model.hpp"

#include <cmath>
#include <cstdint>
#include <cstdlib>  // for std::strtod
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <vector>

using gradsync::DataParallel;
using gradsync::LocalBackend;
using gradsync::MetricsFormat;
using gradsync::StepMetrics;
using gradsync::StepReport;
using testing_support::Toy;

namespace {

const std::vector<std::size_t> metric_toy_sizes{300, 5, 4000};

std::vector<std::string> lines_of(const std::string& path) {
    std::ifstream in(path);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
}

// The value of "name": in one JSON line (numbers and null only, as the writer writes them).
std::string raw_field(const std::string& line, const std::string& name) {
    const auto at = line.find("\"" + name + "\":");
    if (at == std::string::npos) return "<missing>";
    const auto begin = at + name.size() + 3;
    return line.substr(begin, line.find_first_of(",}", begin) - begin);
}
double field(const std::string& line, const std::string& name) {
    return std::strtod(raw_field(line, name).c_str(), nullptr);
}

template <class DP>
constexpr bool can_add_scalar = requires(DP& dp) {
    dp.add_scalar("loss", 1.0);
};

struct Sgd {
    Toy& model;
    void operator()() {
        for (auto& t : model.tensors)
            for (std::size_t i = 0; i < t.w.size(); ++i) t.w[i] -= 0.01f * t.g[i];
    }
};

}  // namespace

TEST_CASE("step reports its time, its synchronization time and the bytes it reduced, with or without metrics") {
    gradsync::spawn(2, [](LocalBackend& b) {
        Toy model(metric_toy_sizes, 1.0f);
        DataParallel dp(model, b);
        for (int step = 0; step < 3; ++step) {
            model.fill_grads(b.rank());
            Sgd sgd{model};
            const StepReport report = dp.step([&] {
                const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
                while (std::chrono::steady_clock::now() < until) {
                }
                sgd();
            });
            CHECK(report.bytes_reduced == dp.gradient_bytes().count());
            CHECK(report.step_seconds >= 0.020);
            // The optimizer's 20 ms are not synchronization.
            CHECK(report.sync_seconds >= 0);
            CHECK(report.sync_seconds < report.step_seconds - 0.019);
        }
    });
}

TEST_CASE("StepMetrics writes one JSON line per step from rank 0, with the trainer's scalars") {
    TempDir dir;
    const std::string path = (dir.path / "metrics.jsonl").string();
    std::vector<StepReport> reports;
    std::mutex mutex;
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy model(metric_toy_sizes, 1.0f);
        DataParallel dp(model, b, gradsync::LinearLr{.base_lr = 0.1}, StepMetrics{path});
        CHECK(dp.metrics_path() == (b.rank() == 0 ? path : std::string{}));
        for (int step = 0; step < 3; ++step) {
            model.fill_grads(b.rank());
            dp.add_scalar("loss", 2.5 - step);
            dp.add_scalar("loss", 2.0 - step);  // the last value of a step wins
            dp.add_scalar("tokens per \"second\"", 1000.0 * step);
            Sgd sgd{model};
            auto report = dp.step([&](double) { sgd(); });
            std::lock_guard lock(mutex);
            if (b.rank() == 0) reports.push_back(report);
        }
    });
    const auto lines = lines_of(path);
    REQUIRE(lines.size() == 3);
    for (std::size_t k = 0; k < 3; ++k) {
        CAPTURE(lines[k]);
        const auto& r = reports[k];
        CHECK(field(lines[k], "step") == double(k + 1));
        CHECK(field(lines[k], "applied") == 1);
        CHECK(field(lines[k], "skipped_steps") == 0);
        CHECK(field(lines[k], "grad_norm") == r.grad_norm);  // written exactly
        CHECK(field(lines[k], "learning_rate") == r.learning_rate);
        CHECK(field(lines[k], "learning_rate") == doctest::Approx(0.2));
        CHECK(field(lines[k], "step_seconds") == r.step_seconds);
        CHECK(field(lines[k], "sync_seconds") == r.sync_seconds);
        CHECK(field(lines[k], "bytes_reduced") == double((300 + 5 + 4000) * sizeof(float)));
        CHECK(field(lines[k], "loss") == 2.0 - double(k));
        CHECK(field(lines[k], "tokens per \\\"second\\\"") == 1000.0 * double(k));
    }
}

TEST_CASE("a skipped step is recorded: not applied, counted, its norm null") {
    TempDir dir;
    const std::string path = (dir.path / "m.jsonl").string();
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy model(metric_toy_sizes, 1.0f);
        DataParallel dp(model, b, gradsync::DynamicLossScale{.init_scale = 1024}, StepMetrics{path});
        for (int step = 0; step < 3; ++step) {
            model.fill_grads(b.rank());
            if (step == 1 && b.rank() == 1) model.tensors[2].g[7] = std::numeric_limits<float>::infinity();
            dp.step([] {});
        }
    });
    const auto lines = lines_of(path);
    REQUIRE(lines.size() == 3);
    CHECK(field(lines[0], "applied") == 1);
    CHECK(field(lines[1], "applied") == 0);
    CHECK(raw_field(lines[1], "grad_norm") == "null");
    CHECK(field(lines[1], "overflowed") == 1);
    CHECK(field(lines[1], "loss_scale") == 1024);
    CHECK(field(lines[1], "next_loss_scale") == 512);
    CHECK(field(lines[1], "skipped_steps") == 1);
    CHECK(field(lines[2], "skipped_steps") == 1);
}

TEST_CASE("ShardedDataParallel writes the same record: its reduce-scatter's bytes, its optimizer apart") {
    TempDir dir;
    const std::string path = (dir.path / "sharded.jsonl").string();
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy model(metric_toy_sizes, 1.0f);
        gradsync::ShardedDataParallel sdp(model, b, StepMetrics{path});
        for (int step = 0; step < 2; ++step) {
            model.fill_grads(b.rank());
            sdp.add_scalar("loss", 1.5);
            auto report = sdp.step([](std::span<const gradsync::ShardPiece<float>>) {});
            CHECK(report.bytes_reduced == sdp.plan().bytes().count());
            CHECK(report.sync_seconds <= report.step_seconds);
        }
    });
    const auto lines = lines_of(path);
    REQUIRE(lines.size() == 2);
    CHECK(field(lines[1], "step") == 2);
    CHECK(field(lines[1], "loss") == 1.5);
    CHECK(field(lines[1], "bytes_reduced") == double((300 + 5 + 4000) * sizeof(float)));
}

TEST_CASE("a metrics file that cannot be opened is refused by every rank at construction") {
    for (const std::string& path : {std::string("/nonexistent-gradsync-dir/m.jsonl"), std::string()}) {
        CAPTURE(path);
        std::vector<std::string> messages(2);
        gradsync::spawn(2, [&](LocalBackend& b) {
            Toy model(metric_toy_sizes, 1.0f);
            try {
                DataParallel dp(model, b, StepMetrics{path});
            } catch (const gradsync::ConfigurationError& e) {
                messages[static_cast<std::size_t>(b.rank())] = e.what();
            }
        });
        for (const auto& m : messages) {
            CAPTURE(m);
            CHECK(m.find("rank 0") != std::string::npos);
            CHECK(m.find(path.empty() ? "StepMetrics needs a path" : path) != std::string::npos);
        }
    }
}

TEST_CASE("a metrics write that fails later is reported, and training goes on") {
    gradsync::spawn(2, [&](LocalBackend& b) {  // /dev/full opens and refuses every write
        Toy model(metric_toy_sizes, 1.0f);
        DataParallel dp(model, b, StepMetrics{"/dev/full"});
        for (int step = 0; step < 2; ++step) {
            model.fill_grads(b.rank());
            Sgd sgd{model};
            CHECK(dp.step([&] { sgd(); }).applied);
        }
        CHECK(dp.steps() == 2);
    });
}

TEST_CASE("add_scalar refuses an empty name and the record's own names") {
    gradsync::spawn(1, [&](LocalBackend& b) {
        Toy model(metric_toy_sizes, 1.0f);
        TempDir dir;
        DataParallel dp(model, b, StepMetrics{(dir.path / "m.jsonl").string()});
        CHECK_THROWS_WITH_AS(dp.add_scalar("", 1), doctest::Contains("needs a name"), gradsync::Error);
        CHECK_THROWS_WITH_AS(dp.add_scalar("grad_norm", 1), doctest::Contains("one step() itself records"),
                             gradsync::Error);
    });
    // Without the policy there is nothing to add to.
    static_assert(!can_add_scalar<DataParallel<Toy, LocalBackend>>);
    static_assert(can_add_scalar<DataParallel<Toy, LocalBackend, StepMetrics>>);
}

namespace {

// A TFRecord file's records, each frame's checksums verified.
std::vector<std::string> tf_records(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream all;
    all << in.rdbuf();
    const std::string bytes = all.str();
    std::vector<std::string> records;
    std::size_t at = 0;
    while (at < bytes.size()) {
        REQUIRE(at + 12 <= bytes.size());
        std::uint64_t length;
        std::uint32_t length_crc, data_crc;
        std::memcpy(&length, bytes.data() + at, 8);
        std::memcpy(&length_crc, bytes.data() + at + 8, 4);
        CHECK(length_crc == gradsync::detail::masked_crc32c(std::string_view(bytes.data() + at, 8)));
        REQUIRE(at + 12 + length + 4 <= bytes.size());
        std::string data = bytes.substr(at + 12, length);
        std::memcpy(&data_crc, bytes.data() + at + 12 + length, 4);
        CHECK(data_crc == gradsync::detail::masked_crc32c(data));
        records.push_back(data);
        at += 12 + length + 4;
    }
    return records;
}

}  // namespace

TEST_CASE("TensorBoard events: CRC-32C as TFRecord frames need it, and one framed event per step") {
    CHECK(gradsync::detail::crc32c("123456789") == 0xE3069283u);  // the check value of CRC-32C
    CHECK(gradsync::detail::crc32c("") == 0u);
    TempDir dir;
    std::string file;
    gradsync::spawn(2, [&](LocalBackend& b) {
        Toy model(metric_toy_sizes, 1.0f);
        DataParallel dp(model, b, StepMetrics{(dir.path / "run").string(), MetricsFormat::tensorboard});
        if (b.rank() == 0) file = dp.metrics_path();
        for (int step = 0; step < 2; ++step) {
            model.fill_grads(b.rank());
            dp.add_scalar("loss", 0.75);
            dp.step([] {});
        }
    });
    CHECK(file.find((dir.path / "run" / "events.out.tfevents.").string()) == 0);
    const auto records = tf_records(file);
    REQUIRE(records.size() == 3);  // the file version, then a step each
    CHECK(records[0].find("brain.Event:2") != std::string::npos);
    CHECK(records[2].find(std::string("\x10\x02", 2)) != std::string::npos);  // step = 2
    float loss = 0.75f;
    std::string loss_value = std::string("\x0a\x04loss\x15", 7) + std::string(reinterpret_cast<char*>(&loss), 4);
    CHECK(records[2].find(loss_value) != std::string::npos);
}
