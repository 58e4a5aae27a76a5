// A coverage-guided fuzz target for the checkpoint reader: the safetensors header parser, and the
// loader behind Checkpoint::load, fed any bytes. Anything but a CheckpointError (a crash, a
// sanitizer report, another exception) is a failure. Built with clang's libFuzzer by
// scripts/fuzz.sh; built without it, it is a program that runs the files it is given (the seed
// corpus and every input that ever failed, in the test suite).
#include <gradsync/checkpoint/checkpoint.hpp>
#include <gradsync/gradsync.hpp>

#include <unistd.h>  // for getpid

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <span>
#include <string>
#include <vector>

namespace {

// What the seed corpus's valid checkpoints fit (tests/fuzz/make_corpus.py writes them).
struct Model {
    std::vector<float> w = std::vector<float>(6, 1.0f), gw = std::vector<float>(6);
    std::vector<double> v = std::vector<double>(2, 1.0), gv = std::vector<double>(2);
    std::vector<gradsync::Parameter> parameters() {
        return {gradsync::parameter("w", w, gw), gradsync::parameter("v", v, gv)};
    }
};

void run_one(const std::uint8_t* data, std::size_t size) {
    const auto* first = reinterpret_cast<const std::byte*>(data);
    try {
        gradsync::SafetensorsFile file("input", std::vector<std::byte>(first, first + size));
        for (const auto& t : file.tensors()) (void)t.bytes.size();
    } catch (const gradsync::CheckpointError&) {
    }
    static const auto path =
        std::filesystem::temp_directory_path() / ("gradsync_fuzz_" + std::to_string(::getpid()) + ".safetensors");
    {
        std::ofstream out(path, std::ios::binary | std::ios::trunc);
        out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    }
    static auto group = gradsync::LocalBackend::create_group(1);
    Model model;
    gradsync::DataParallel dp(model, group[0], gradsync::DynamicLossScale{});
    std::vector<float> moment(3, 0.0f);
    gradsync::ShardedSampler sampler(100, 1, 0, {});
    try {
        gradsync::Checkpoint().add("moment", std::span(moment)).add(sampler).load(path, dp);
    } catch (const gradsync::CheckpointError&) {
    }
    std::error_code ignored;  // removed after each input: nothing left behind however the run ends
    std::filesystem::remove(path, ignored);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    run_one(data, size);
    return 0;
}

#ifndef GRADSYNC_LIBFUZZER
// Runs every file named, or every file in each folder named; says how many.
int main(int argc, char** argv) {
    int count = 0;
    auto run_file = [&](const std::filesystem::path& p) {
        std::ifstream in(p, std::ios::binary);
        const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        run_one(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
        ++count;
    };
    for (int i = 1; i < argc; ++i) {
        if (std::filesystem::is_directory(argv[i])) {
            for (const auto& e : std::filesystem::directory_iterator(argv[i]))
                if (e.is_regular_file()) run_file(e.path());
        } else {
            run_file(argv[i]);
        }
    }
    std::printf("fuzz_checkpoint: %d inputs, every one read or refused with a CheckpointError\n", count);
    return count > 0 ? 0 : 1;
}
#endif
