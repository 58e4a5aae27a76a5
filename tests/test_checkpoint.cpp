// Checkpoints: the safetensors file format, atomic writes that survive a crash at any byte,
// clear errors for corrupt or mismatched files on every rank, and exact resume.
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "support/resume_run.hpp"
#include "support/temp_dir.hpp"

#include <sys/stat.h>  // for mkfifo
#include <sys/wait.h>  // for waitpid
#include <unistd.h>    // for fork, _exit

#include <csignal>  // for raise, SIGKILL
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

void write_all(const fs::path& p, const std::string& bytes) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out << bytes;
}

std::string file_text(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
}

std::vector<std::byte> read_all(const fs::path& p) {
    const auto text = file_text(p);
    std::vector<std::byte> bytes(text.size());
    std::memcpy(bytes.data(), text.data(), text.size());
    return bytes;
}

// A file with the given JSON header and `data_bytes` zero bytes of data.
std::string safetensors_bytes(const std::string& header, std::size_t data_bytes) {
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[std::size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
    return out + header + std::string(data_bytes, '\0');
}

}  // namespace

// Temporary files of writers of `name` left in `dir`.
std::size_t temporaries(const fs::path& dir, const std::string& name) {
    std::size_t n = 0;
    for (const auto& entry : fs::directory_iterator(dir))
        n += entry.path().filename().string().rfind(name + ".tmp.", 0) == 0;
    return n;
}

TEST_CASE("safetensors: two writers of one path never share a temporary: the path always holds one whole file") {
    TempDir dir;
    const auto path = dir.path / "shared.safetensors";
    std::vector<float> ones(20000, 1.0f), twos(20000, 2.0f);
    auto write = [&](std::vector<float>& v) {
        for (int k = 0; k < 30; ++k)
            gradsync::write_safetensors(path,
                                        std::vector<gradsync::TensorBytes>{
                                            {"w", gradsync::DType::float32, {v.size()}, std::as_bytes(std::span(v))}},
                                        {});
    };
    gradsync::write_safetensors(path,
                                std::vector<gradsync::TensorBytes>{
                                    {"w", gradsync::DType::float32, {ones.size()}, std::as_bytes(std::span(ones))}},
                                {});
    std::atomic<bool> done{false};
    std::atomic<int> torn{0};
    std::thread reader([&] {
        while (!done) {
            try {
                gradsync::SafetensorsFile f(path);
                const auto bytes = f.find("w")->bytes;
                float first = 0, last = 0;
                std::memcpy(&first, bytes.data(), 4);
                std::memcpy(&last, bytes.data() + bytes.size() - 4, 4);
                torn += bytes.size() != 80000 || first != last;
            } catch (const gradsync::CheckpointError&) {
                ++torn;
            }
        }
    });
    std::thread a([&] { write(ones); }), b([&] { write(twos); });
    a.join();
    b.join();
    done = true;
    reader.join();
    CHECK(torn.load() == 0);
    CHECK(temporaries(dir.path, "shared.safetensors") == 0);
}

TEST_CASE("safetensors: what is written reads back, with an 8-byte aligned data section") {
    TempDir dir;
    std::vector<float> a{1.5f, -2.0f, 3.25f};
    std::vector<double> b{1e300, -0.0};
    std::vector<gradsync::bfloat16> c{gradsync::bfloat16(1.0f), gradsync::bfloat16(-7.0f)};
    std::vector<std::int64_t> d{42};
    std::vector<gradsync::TensorBytes> tensors{
        {"layer.a", gradsync::DType::float32, {3}, std::as_bytes(std::span(a))},
        {"b", gradsync::DType::float64, {1, 2}, std::as_bytes(std::span(b))},
        {"c", gradsync::DType::bfloat16, {2}, std::as_bytes(std::span(c))},
        {"d", gradsync::DType::int64, {}, std::as_bytes(std::span(d))},  // a scalar: shape []
    };
    const auto path = dir.path / "x.safetensors";
    gradsync::write_safetensors(path, tensors, {{"gradsync.step", "7"}});
    CHECK(temporaries(dir.path, "x.safetensors") == 0);
    auto raw = file_text(path);
    std::uint64_t header = 0;
    std::memcpy(&header, raw.data(), 8);  // little-endian, as this machine
    CHECK((8 + header) % 8 == 0);
    CHECK(raw.substr(8, 1) == "{");

    gradsync::SafetensorsFile file(path);
    CHECK(file.metadata().at("gradsync.step") == "7");
    REQUIRE(file.tensors().size() == 4);
    for (const auto& t : tensors) {
        const auto* r = file.find(t.name);
        REQUIRE(r != nullptr);
        CHECK(r->dtype == t.dtype);
        CHECK(r->shape == t.shape);
        CHECK(std::equal(r->bytes.begin(), r->bytes.end(), t.bytes.begin(), t.bytes.end()));
    }
}

TEST_CASE("safetensors: a corrupt or truncated file is a clear error, never a crash or a silent load") {
    TempDir dir;
    const auto path = dir.path / "bad.safetensors";
    struct Case {
        std::string bytes;
        std::string expected;
    };
    const std::string good_header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
    const std::vector<Case> cases{
        {"", "fewer than a header length needs"},
        {safetensors_bytes(good_header, 8).substr(0, 30), "truncated or not a safetensors file"},
        {safetensors_bytes("{not json", 0), "its header is not JSON"},
        {safetensors_bytes("[1,2]", 0), "not a JSON object"},
        {safetensors_bytes(R"({"w":{"dtype":"F32","shape":[2]}})", 8), "lacks dtype, shape or data_offsets"},
        {safetensors_bytes(R"({"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8), "not one gradsync knows"},
        {safetensors_bytes(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "shape entry -2"},
        {safetensors_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8), "outside the file's 8"},
        {safetensors_bytes(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
         "has 8 bytes, but its shape and dtype say 12"},
        {safetensors_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("v":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                           8),
         "overlap"},
        {safetensors_bytes(R"({"__metadata__":{"k":1}})", 0), "'k' is 1, not a string"},
    };
    for (const auto& c : cases) {
        CAPTURE(c.expected);
        write_all(path, c.bytes);
        CHECK_THROWS_WITH_AS(gradsync::SafetensorsFile{path}, doctest::Contains(c.expected.c_str()),
                             gradsync::CheckpointError);
    }
    CHECK_THROWS_WITH_AS(gradsync::SafetensorsFile{dir.path / "missing"}, doctest::Contains("cannot open it"),
                         gradsync::CheckpointError);
}

TEST_CASE("safetensors: a crash at any byte of a save leaves the previous checkpoint intact") {
    TempDir dir;
    const auto path = dir.path / "ckpt.safetensors";
    std::vector<float> old_values(1000, 1.0f), new_values(1000, 2.0f);
    auto tensors = [](std::vector<float>& v) {
        return std::vector<gradsync::TensorBytes>{
            {"w", gradsync::DType::float32, {v.size()}, std::as_bytes(std::span(v))}};
    };
    gradsync::write_safetensors(path, tensors(old_values), {});
    const auto before = read_all(path);
    // The writer dies (SIGKILL, so nothing is cleaned up) after 0, 8, ... bytes, and after the
    // last byte but before the rename.
    for (std::size_t kill_at : {std::size_t{1}, std::size_t{8}, std::size_t{100}, std::size_t{2000}, std::size_t{4000},
                                std::size_t{100000}}) {
        CAPTURE(kill_at);
        const pid_t child = ::fork();
        REQUIRE(child >= 0);
        if (child == 0) {
            gradsync::SafetensorsWriteOptions options;
            options.on_write = [kill_at](std::size_t written) {
                if (written >= kill_at) std::raise(SIGKILL);
            };
            try {
                gradsync::write_safetensors(path, tensors(new_values), {}, options);
            } catch (...) {
            }
            ::_exit(0);  // only reached when kill_at is past the end of the file
        }
        int status = 0;
        ::waitpid(child, &status, 0);
        const bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
        const auto after = read_all(path);
        if (killed) {
            CHECK(after == before);  // the previous file, untouched
            gradsync::SafetensorsFile f(path);
            CHECK(f.find("w")->bytes.size() == 4000);
        } else {
            gradsync::SafetensorsFile f(path);  // the new file, whole
            float first = 0;
            std::memcpy(&first, f.find("w")->bytes.data(), 4);
            CHECK(first == 2.0f);
        }
    }
    // A later save succeeds beside the killed writers' temporaries, and leaves none of its own.
    const auto left = temporaries(dir.path, "ckpt.safetensors");
    gradsync::write_safetensors(path, tensors(new_values), {});
    CHECK(temporaries(dir.path, "ckpt.safetensors") == left);
    CHECK(gradsync::SafetensorsFile(path).find("w")->bytes.size() == 4000);
}

TEST_CASE("checkpoint: resuming is exact, bit for bit: 10 steps == 5 steps, save, new group, load, 5 steps") {
    TempDir dir;
    const auto path = (dir.path / "run.safetensors").string();
    for (int world : {1, 2, 3}) {
        CAPTURE(world);
        const auto n = static_cast<std::size_t>(world);
        std::vector<resume::Outcome> straight(n), resumed(n);
        gradsync::spawn(world, [&](gradsync::LocalBackend& b) {
            straight[std::size_t(b.rank())] = resume::run_steps(b, 0, 10, "", "");
        });
        gradsync::spawn(world, [&](gradsync::LocalBackend& b) { resume::run_steps(b, 0, 5, "", path); });
        gradsync::spawn(world, [&](gradsync::LocalBackend& b) {  // a new process group
            resumed[std::size_t(b.rank())] = resume::run_steps(b, 5, 10, path, "");
        });
        for (int r = 0; r < world; ++r) {
            const auto& s = straight[std::size_t(r)];
            const auto& x = resumed[std::size_t(r)];
            CHECK(std::memcmp(s.weights.data(), x.weights.data(), s.weights.size() * 4) == 0);
            CHECK(std::memcmp(s.velocity0.data(), x.velocity0.data(), s.velocity0.size() * 4) == 0);
            CHECK(s.loss_scale == x.loss_scale);
            CHECK(s.steps == x.steps);
            CHECK(s.epoch == x.epoch);
        }
        CHECK(straight[0].loss_scale != 1024.0f);  // the scaler moved: its state mattered
        CHECK(straight[0].epoch > 0);              // and so did the sampler's
    }
}

TEST_CASE("checkpoint: saved before its first step, a dynamic loss scale loads as the scale it would have used") {
    TempDir dir;
    const auto path = dir.path / "early.safetensors";
    struct Model {
        std::vector<float> w = std::vector<float>(4, 1.0f), g = std::vector<float>(4, 0.5f);
        std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", w, g)}; }
    };
    const gradsync::DynamicLossScale scaler{.init_scale = 4096.0f};
    {
        Model model;
        auto group = gradsync::LocalBackend::create_group(1);
        gradsync::DataParallel dp(model, group[0], scaler);
        dp.synchronize();  // synchronize() alone: the scaler never learns an outcome
        REQUIRE(dp.loss_scaler().state.scale == 0.0f);
        gradsync::Checkpoint().save(path, dp);
    }
    Model model;
    auto group = gradsync::LocalBackend::create_group(1);
    gradsync::DataParallel dp(model, group[0], gradsync::DynamicLossScale{.init_scale = 8.0f});
    gradsync::Checkpoint().load(path, dp);
    CHECK(dp.loss_scale() == 4096.0f);
    CHECK(dp.loss_scaler().state == gradsync::DynamicLossScale::State{4096.0f, 0, 0});
}

TEST_CASE("checkpoint: a file that does not fit the model fails on every rank, and changes nothing") {
    TempDir dir;
    const auto path = (dir.path / "model.safetensors").string();
    struct Model {
        std::vector<float> w = std::vector<float>(6, 1.0f), gw = std::vector<float>(6);
        std::vector<double> v = std::vector<double>(2, 1.0), gv = std::vector<double>(2);
        std::vector<gradsync::Parameter> parameters() {
            return {gradsync::parameter("w", w, gw), gradsync::parameter("v", v, gv)};
        }
    };
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        Model m;
        gradsync::DataParallel dp(m, b);
        gradsync::Checkpoint().save(path, dp);
    });
    const std::string saved = file_text(path);
    auto expect_failure = [&](auto setup, const std::string& expected) {
        CAPTURE(expected);
        std::mutex mutex;
        std::vector<std::string> messages;
        gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
            Model m;
            std::vector<float> extra(3, 5.0f);
            gradsync::DataParallel dp(m, b);
            gradsync::Checkpoint checkpoint;
            setup(m, checkpoint, extra);
            m.w.assign(6, 9.0f);
            try {
                checkpoint.load(path, dp);
            } catch (const gradsync::CheckpointError& e) {
                std::lock_guard lock(mutex);
                messages.push_back(e.what());
            }
            CHECK(m.w[0] == 9.0f);  // untouched
        });
        REQUIRE(messages.size() == 2);
        CHECK(messages[0] == messages[1]);
        CHECK(messages[0].find(expected) != std::string::npos);
    };
    auto nothing = [](Model&, gradsync::Checkpoint&, std::vector<float>&) {};
    expect_failure([](Model&, gradsync::Checkpoint& c, std::vector<float>& e) { c.add("extra", std::span(e)); },
                   "it has no tensor 'extra'");
    write_all(path, saved);
    {
        // The same names with another size or dtype: rewrite the file with w of 5 elements.
        std::vector<float> w5(5);
        std::vector<double> v(2);
        gradsync::write_safetensors(
            path,
            std::vector<gradsync::TensorBytes>{{"w", gradsync::DType::float32, {5}, std::as_bytes(std::span(w5))},
                                               {"v", gradsync::DType::float64, {2}, std::as_bytes(std::span(v))}},
            {{"gradsync.step", "0"}});
        expect_failure(nothing, "tensor 'w' has 5 elements there and 6 here");
        std::vector<float> vf(2);
        std::vector<float> w6(6);
        gradsync::write_safetensors(
            path,
            std::vector<gradsync::TensorBytes>{{"w", gradsync::DType::float32, {6}, std::as_bytes(std::span(w6))},
                                               {"v", gradsync::DType::float32, {2}, std::as_bytes(std::span(vf))},
                                               {"stray", gradsync::DType::float32, {2}, std::as_bytes(std::span(vf))}},
            {{"gradsync.step", "0"}});
        expect_failure(nothing, "tensor 'v' is float32 there and float64 here");
    }
    write_all(path, saved.substr(0, saved.size() - 4));
    expect_failure(nothing, "outside the file's");
    write_all(path, saved);
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {  // the intact file loads
        Model m;
        m.w.assign(6, 9.0f);
        gradsync::DataParallel dp(m, b);
        gradsync::Checkpoint().load(path, dp);
        CHECK(m.w[0] == 1.0f);
    });
}

TEST_CASE("checkpoint: a save that cannot be written fails on every rank with the reason") {
    std::mutex mutex;
    std::vector<std::string> messages;
    gradsync::spawn(2, [&](gradsync::LocalBackend& b) {
        std::vector<float> w(4), g(4);
        struct Model {
            std::vector<float>*w, *g;
            std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", *w, *g)}; }
        } m{&w, &g};
        gradsync::DataParallel dp(m, b);
        try {
            gradsync::Checkpoint().save("/nonexistent-dir/x.safetensors", dp);
        } catch (const gradsync::CheckpointError& e) {
            std::lock_guard lock(mutex);
            messages.push_back(e.what());
        }
    });
    REQUIRE(messages.size() == 2);
    CHECK(messages[0] == messages[1]);
    CHECK(messages[0].find("cannot create /nonexistent-dir/x.safetensors.tmp.") != std::string::npos);
}

TEST_CASE("checkpoint: a save refuses replicas that differ from rank 0's, naming the tensor, and writes nothing") {
    TempDir dir;
    const auto path = dir.path / "model.safetensors";
    auto save_with = [&](int odd_rank, bool odd_extra) {
        std::mutex mutex;
        std::vector<std::string> messages;
        gradsync::spawn(3, [&](gradsync::LocalBackend& b) {
            std::vector<float> w(4, 1.0f), g(4), moment(8, 0.5f);
            struct Model {
                std::vector<float>*w, *g;
                std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", *w, *g)}; }
            } m{&w, &g};
            gradsync::DataParallel dp(m, b);
            if (b.rank() == odd_rank) (odd_extra ? moment[7] : w[2]) = 2.0f;
            try {
                gradsync::Checkpoint().add("adam.m", std::span(moment)).save(path, dp);
            } catch (const gradsync::ReplicaMismatch& e) {
                std::lock_guard lock(mutex);
                messages.push_back(e.what());
            }
        });
        return messages;
    };
    auto parameter = save_with(2, false);
    REQUIRE(parameter.size() == 3);
    CHECK(parameter[0] == parameter[2]);
    CHECK(parameter[0].find("checkpoint save after step 0: the ranks' replicas differ: parameter 'w' on rank 2 is not "
                            "rank 0's") != std::string::npos);
    auto extra = save_with(1, true);
    REQUIRE(extra.size() == 3);
    CHECK(extra[0].find("checkpointed tensor 'adam.m' on rank 1 is not rank 0's") != std::string::npos);
    CHECK_FALSE(fs::exists(path));
    CHECK(save_with(-1, false).empty());
    CHECK(fs::exists(path));
}

TEST_CASE("checkpoint: a rank that would load other tensors than rank 0 fails every rank, and nothing changes") {
    TempDir dir;
    const auto path = dir.path / "model.safetensors";
    std::vector<std::string> messages;
    std::mutex mutex;
    for (const bool save : {true, false}) {
        gradsync::spawn(3, [&](gradsync::LocalBackend& b) {
            std::vector<float> w(4, save ? 1.0f : 7.0f), g(4);
            // On loading, rank 1's optimizer moment is larger than what was saved (and than rank 0's).
            std::vector<float> moment(!save && b.rank() == 1 ? 10 : 8, save ? 0.5f : 3.0f);
            struct Model {
                std::vector<float>*w, *g;
                std::vector<gradsync::Parameter> parameters() { return {gradsync::parameter("w", *w, *g)}; }
            } m{&w, &g};
            gradsync::DataParallel dp(m, b);
            gradsync::Checkpoint checkpoint;
            checkpoint.add("adam.m", std::span(moment));
            if (save) return checkpoint.save(path, dp);
            try {
                checkpoint.load(path, dp);
            } catch (const gradsync::CheckpointError& e) {
                std::lock_guard lock(mutex);
                messages.push_back(e.what());
            }
            CHECK(w[0] == 7.0f);  // nothing restored on any rank
            CHECK(moment[0] == 3.0f);
        });
    }
    REQUIRE(messages.size() == 3);
    CHECK(messages[0] == messages[1]);
    CHECK(messages[1] == messages[2]);
    CHECK(messages[0].find("cannot be loaded alike on every rank: rank 1 would load tensor #1 otherwise than rank 0, "
                           "which loads 'adam.m' as 8 x float32") != std::string::npos);
}

TEST_CASE("safetensors: hostile files are refused with a short CheckpointError naming the file, never a crash") {
    // tests/fuzz/regressions: one file per class of damage (overflowing shapes and offsets, deep
    // nesting, non-finite or out-of-range metadata, huge names and header lengths), and every
    // input the fuzz target ever failed on.
    struct Model {
        std::vector<float> w = std::vector<float>(6, 9.0f), gw = std::vector<float>(6);
        std::vector<double> v = std::vector<double>(2, 9.0), gv = std::vector<double>(2);
        std::vector<gradsync::Parameter> parameters() {
            return {gradsync::parameter("w", w, gw), gradsync::parameter("v", v, gv)};
        }
    };
    auto load = [](const fs::path& path, Model& model) {
        auto group = gradsync::LocalBackend::create_group(1);
        gradsync::DataParallel dp(model, group[0], gradsync::DynamicLossScale{});
        std::vector<float> moment(3, 0.0f);
        gradsync::ShardedSampler sampler(100, 1, 0, {});
        gradsync::Checkpoint().add("moment", std::span(moment)).add(sampler).load(path, dp);
        return dp.steps();
    };
    int files = 0;
    for (const auto& entry : fs::directory_iterator(fs::path(GRADSYNC_FUZZ_DIR) / "regressions")) {
        CAPTURE(entry.path());
        Model model;
        std::string message;
        try {
            load(entry.path(), model);
        } catch (const gradsync::CheckpointError& e) {
            message = e.what();
        }
        CHECK(message.find(entry.path().string()) != std::string::npos);
        CHECK(message.size() < 600);  // no hostile structure is quoted whole
        CHECK(model.w[0] == 9.0f);    // nothing restored
        ++files;
    }
    CHECK(files >= 20);
    Model model;
    CHECK(load(fs::path(GRADSYNC_FUZZ_DIR) / "corpus" / "valid.safetensors", model) == 7);
    CHECK(model.w[0] == 1.0f);
}

TEST_CASE("safetensors: a directory, a FIFO or a device is refused without reading it") {
    TempDir dir;
    CHECK_THROWS_WITH_AS(gradsync::SafetensorsFile{dir.path}, doctest::Contains("is unreadable: it is a directory"),
                         gradsync::CheckpointError);
    const auto fifo = dir.path / "fifo";
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    CHECK_THROWS_WITH_AS(gradsync::SafetensorsFile{fifo}, doctest::Contains("is unreadable: it is not a regular file"),
                         gradsync::CheckpointError);  // and no wait for a writer
    CHECK_THROWS_WITH_AS(gradsync::SafetensorsFile{"/dev/zero"},
                         doctest::Contains("/dev/zero is unreadable: it is not a regular file"),
                         gradsync::CheckpointError);
}
