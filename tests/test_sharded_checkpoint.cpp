// Checkpoints of ShardedDataParallel: each rank saves its pieces of the optimizer state to a
// shard file; resuming is bitwise exact; a load into another number of ranks or another bucket
// plan gives every rank exactly the state elements it now owns; a missing, stale or foreign shard
// fails every rank alike and changes nothing; earlier saves' shard files are removed.
#include <gradsync/backend/local.hpp>
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/sharded_resume.hpp"
#include "support/sharded_training.hpp"
#include "support/temp_dir.hpp"

#include <algorithm>  // for std::count
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace gradsync::literals;
namespace fs = std::filesystem;

namespace {

using sharded_resume::Outcome;
using sharded_resume::run;
using Tensors = sharded_resume::Tensors;
using sharded::bitwise_equal;

// The moments of every rank, each element from the rank that owns it (the others hold 0 there).
Tensors merged(const std::vector<Outcome>& ranks, Tensors Outcome::*moments) {
    Tensors sum = ranks.front().*moments;
    for (std::size_t r = 1; r < ranks.size(); ++r)
        for (std::size_t p = 0; p < sum.size(); ++p)
            for (std::size_t i = 0; i < sum[p].size(); ++i) sum[p][i] += (ranks[r].*moments)[p][i];
    return sum;
}

std::vector<Outcome> spawn_run(int world, gradsync::SizeCappedBuckets caps, int first, int last, const fs::path& load,
                               const fs::path& save) {
    std::vector<Outcome> out(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](gradsync::LocalBackend& b) {
        out[static_cast<std::size_t>(b.rank())] = run(b, caps, first, last, load, save);
    });
    return out;
}

std::set<std::string> files_in(const fs::path& dir) {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
    return names;
}

const gradsync::SizeCappedBuckets small_buckets{.cap = 16_KiB, .first_cap = 4_KiB};

}  // namespace

TEST_CASE("sharded checkpoint: resuming is exact, bit for bit: 8 steps == 4, save, new group, load, 4") {
    TempDir dir;
    const auto path = dir.path / "run.safetensors";
    for (int world : {1, 2, 3}) {
        CAPTURE(world);
        const auto straight = spawn_run(world, small_buckets, 0, 8, {}, {});
        spawn_run(world, small_buckets, 0, 4, {}, path);
        const auto resumed = spawn_run(world, small_buckets, 4, 8, path, {});
        for (std::size_t r = 0; r < straight.size(); ++r) {
            CAPTURE(r);
            CHECK(bitwise_equal(straight[r].weights, resumed[r].weights));
            CHECK(bitwise_equal(straight[r].m1, resumed[r].m1));
            CHECK(bitwise_equal(straight[r].m2, resumed[r].m2));
            CHECK(resumed[r].steps == 8);
            CHECK(resumed[r].t == 8);
            CHECK(resumed[r].loss_scale == straight[r].loss_scale);
        }
        CHECK(straight[0].loss_scale == 4096.0f);  // the scaler moved: its state mattered
        // One main file, its lock file and one shard file per rank, nothing else.
        CHECK(files_in(dir.path).size() == 2 + static_cast<std::size_t>(world));
        CHECK(files_in(dir.path).count("run.safetensors.lock") == 1);
    }
}

TEST_CASE("sharded checkpoint: a load into another number of ranks or bucket plan gives each rank its elements") {
    TempDir dir;
    const auto path = dir.path / "reshard.safetensors";
    const gradsync::SizeCappedBuckets plans[] = {gradsync::SizeCappedBuckets{}, small_buckets};
    const std::pair<int, int> moves[] = {{2, 3}, {3, 2}, {4, 1}, {1, 4}, {2, 2}};
    for (const auto& [from, to] : moves)
        for (const auto& saved_plan : plans)
            for (const auto& loaded_plan : plans) {
                CAPTURE(from);
                CAPTURE(to);
                CAPTURE(saved_plan.settings());
                CAPTURE(loaded_plan.settings());
                const auto saved = spawn_run(from, saved_plan, 0, 3, {}, path);
                const auto loaded = spawn_run(to, loaded_plan, 3, 3, path, {});  // load, no step
                CHECK(bitwise_equal(merged(saved, &Outcome::m1), merged(loaded, &Outcome::m1)));
                CHECK(bitwise_equal(merged(saved, &Outcome::m2), merged(loaded, &Outcome::m2)));
                for (const auto& r : loaded) {
                    CHECK(bitwise_equal(r.weights, saved[0].weights));
                    CHECK(r.steps == 3);
                    CHECK(r.t == 3);
                    CHECK(r.loss_scale == saved[0].loss_scale);
                }
                CHECK(merged(saved, &Outcome::m2)[0][0] != 0.0f);  // the state is not trivially zero
            }
}

TEST_CASE("sharded checkpoint: a missing, stale or foreign shard fails every rank alike and changes nothing") {
    TempDir dir;
    const auto path = dir.path / "bad.safetensors", other = dir.path / "other.safetensors";
    spawn_run(2, small_buckets, 0, 2, {}, path);
    const auto shard1 = dir.path / gradsync::detail::shard_file_name(path, 2, 1, 2);
    REQUIRE(fs::exists(shard1));

    // Every rank throws the same message, and its model and state stay as they were.
    auto expect_failure = [&](const std::string& part) {
        std::vector<std::string> messages(2);
        gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
            mlp::Mlp model(/*seed=*/5);
            gradsync::ShardedDataParallel sdp(model, b, small_buckets);
            const auto before = model.w1;
            std::vector<float> m1(sdp.state_elements(), 7.0f), m2(sdp.state_elements(), 7.0f);
            gradsync::Checkpoint checkpoint;
            checkpoint.add_shard("adam.m1", std::span(m1)).add_shard("adam.m2", std::span(m2));
            int t = -1;
            checkpoint.add("adam.t", std::span(&t, 1));
            try {
                checkpoint.load(path, sdp);
            } catch (const gradsync::CheckpointError& e) {
                messages[static_cast<std::size_t>(b.rank())] = e.what();
            }
            CHECK(model.w1 == before);
            CHECK(t == -1);
            CHECK(std::count(m1.begin(), m1.end(), 7.0f) == static_cast<std::ptrdiff_t>(m1.size()));
            CHECK(sdp.steps() == 0);
        });
        CAPTURE(messages[0]);
        CHECK(messages[0].find(part) != std::string::npos);
        CHECK(messages[0] == messages[1]);
    };

    SUBCASE("a shard file is missing") {
        fs::remove(shard1);
        expect_failure("shard 1 of checkpoint " + path.string());
    }
    SUBCASE("a shard file of another save under the listed name") {
        spawn_run(2, gradsync::SizeCappedBuckets{}, 0, 2, {}, other);  // the same step, other pieces
        fs::copy_file(dir.path / gradsync::detail::shard_file_name(other, 2, 1, 2), shard1,
                      fs::copy_options::overwrite_existing);
        expect_failure("is not the one the checkpoint lists");
    }
    SUBCASE("a shard file cut short") {
        fs::resize_file(shard1, fs::file_size(shard1) - 4);
        expect_failure("is unreadable");
    }
    SUBCASE("sharded state loaded without add_shard") {
        std::vector<std::string> messages(2);
        gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
            mlp::Mlp model(/*seed=*/5);
            gradsync::ShardedDataParallel sdp(model, b, small_buckets);
            int t = 0;
            gradsync::Checkpoint checkpoint;
            checkpoint.add("adam.t", std::span(&t, 1));
            CHECK_THROWS_WITH_AS(checkpoint.load(path, sdp), doctest::Contains("shard files"),
                                 gradsync::CheckpointError);
        });
    }
}

TEST_CASE("sharded checkpoint: state of the wrong size, or add_shard with DataParallel, is refused on every rank") {
    TempDir dir;
    const auto path = dir.path / "refused.safetensors";
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        mlp::Mlp model(/*seed=*/5);
        gradsync::ShardedDataParallel sdp(model, b);
        std::vector<float> state(sdp.state_elements() + static_cast<std::size_t>(b.rank()));  // rank 1: one too many
        gradsync::Checkpoint checkpoint;
        checkpoint.add_shard("m", std::span(state));
        CHECK_THROWS_WITH_AS(checkpoint.save(path, sdp), doctest::Contains("rank 1"), gradsync::CheckpointError);
    });
    CHECK_FALSE(fs::exists(path));
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        mlp::Mlp model(/*seed=*/5);
        gradsync::DataParallel dp(model, b);
        std::vector<float> state(10);
        gradsync::Checkpoint checkpoint;
        checkpoint.add_shard("m", std::span(state));
        CHECK_THROWS_WITH_AS(checkpoint.save(path, dp), doctest::Contains("only a ShardedDataParallel has"),
                             gradsync::CheckpointError);
    });
    CHECK(files_in(dir.path).empty());
}

TEST_CASE("sharded checkpoint: a new save removes the shard files of earlier saves of the same path only") {
    TempDir dir;
    const auto path = dir.path / "keep.safetensors", neighbour = dir.path / "keep2.safetensors";
    spawn_run(2, small_buckets, 0, 1, {}, neighbour);
    spawn_run(3, small_buckets, 0, 1, {}, path);
    spawn_run(2, small_buckets, 0, 2, {}, path);
    const std::set<std::string> expected{"keep.safetensors",
                                         "keep.safetensors.lock",
                                         gradsync::detail::shard_file_name(path, 2, 0, 2),
                                         gradsync::detail::shard_file_name(path, 2, 1, 2),
                                         "keep2.safetensors",
                                         "keep2.safetensors.lock",
                                         gradsync::detail::shard_file_name(neighbour, 1, 0, 2),
                                         gradsync::detail::shard_file_name(neighbour, 1, 1, 2)};
    CHECK(files_in(dir.path) == expected);
    CHECK(gradsync::detail::is_shard_file_of(path, "keep.safetensors.step-12.shard-0-of-3.safetensors"));
    CHECK_FALSE(gradsync::detail::is_shard_file_of(path, "keep.safetensors.step-12.shard-0-of-3.safetensors.tmp"));
    CHECK_FALSE(gradsync::detail::is_shard_file_of(path, "keep.safetensors.step-x.shard-0-of-3.safetensors"));
    CHECK_FALSE(gradsync::detail::is_shard_file_of(neighbour, "keep.safetensors.step-1.shard-0-of-3.safetensors"));
}

TEST_CASE("sharded checkpoint: two trainers saving one path and a reader loading it meanwhile all succeed") {
    // Without turns, one save's removal of earlier saves' shards removes the other's new ones, and
    // a load meets shard files a save has just removed.
    TempDir dir;
    const auto path = dir.path / "shared.safetensors";
    spawn_run(2, small_buckets, 0, 1, {}, path);
    std::atomic<int> failures{0}, loads{0};
    std::atomic<bool> saving{true};
    std::string first_failure;
    std::mutex failure_mutex;
    auto attempt = [&](auto&& f) {
        try {
            f();
        } catch (const std::exception& e) {
            std::lock_guard lock(failure_mutex);
            if (failures++ == 0) first_failure = e.what();
        }
    };
    auto saver = [&](int last) {
        for (int k = 0; k < 6; ++k) attempt([&] { spawn_run(2, small_buckets, 0, last, {}, path); });
    };
    std::thread reader([&] {
        while (saving) {
            attempt([&] {
                spawn_run(2, small_buckets, 0, 0, path, {});
                ++loads;
            });
            std::this_thread::sleep_for(std::chrono::milliseconds(10));  // the saves' turn
        }
    });
    std::thread a(saver, 2), b(saver, 3);
    a.join();
    b.join();
    saving = false;
    reader.join();
    CHECK_MESSAGE(failures == 0, first_failure);
    CHECK(loads > 0);
    const auto loaded = spawn_run(2, small_buckets, 0, 0, path, {});  // whole: one save's shards, all there
    CHECK((loaded[0].steps == 2 || loaded[0].steps == 3));
    std::size_t shard_files = 0;
    for (const auto& name : files_in(dir.path)) shard_files += gradsync::detail::is_shard_file_of(path, name);
    CHECK(shard_files == 2);
}

TEST_CASE(
    "sharded checkpoint: a save that cannot take its turn within lock_wait fails on every rank, naming the lock") {
    TempDir dir;
    const auto path = dir.path / "busy.safetensors";
    spawn_run(2, small_buckets, 0, 1, {}, path);
    const gradsync::detail::PathLock held(path, gradsync::detail::PathLock::Mode::shared, std::chrono::seconds(1));
    std::vector<std::string> errors(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        mlp::Mlp model(/*seed=*/5);
        gradsync::ShardedDataParallel sdp(model, b, small_buckets);
        std::vector<float> m1(sdp.state_elements(), 0.0f);
        gradsync::Checkpoint checkpoint(
            gradsync::Checkpoint::Options{.write = {}, .lock_wait = std::chrono::milliseconds(200)});
        checkpoint.add_shard("adam.m1", std::span(m1));
        try {
            checkpoint.save(path, sdp);
        } catch (const gradsync::CheckpointError& e) {
            errors[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& e : errors)
        CHECK_MESSAGE(e.find("held its lock (" + path.string() + ".lock) for 200 ms") != std::string::npos, e);
    CHECK(spawn_run(2, small_buckets, 0, 0, path, {})[0].steps == 1);  // the earlier save is whole
}
