// NcclBackend and DataParallel over it, run on the stand-ins for the CUDA runtime and NCCL
// (tests/standin): the host side of the GPU path, as far as a CPU can take it. On 1 to 4 ranks
// (threads, one stand-in device each) the collectives and DataParallel give what LocalBackend
// gives, bitwise where the summation order is the same (every sum in rank order; NCCL's average
// pre-multiplies by 1/ranks, which is exact for 1, 2 and 4 ranks); the non-blocking protocol is
// polled through; and the failure paths end every rank by its deadline.
#include <doctest/doctest.h>

#include "standin/standin.hpp"

#include <gradsync/backend/local.hpp>
#include <gradsync/backend/nccl.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/launch/nccl_spawn.hpp>
#include <gradsync/launch/spawn.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

// Device memory for a test, freed at the end of scope.
template <class T>
struct DeviceArray {
    explicit DeviceArray(std::size_t n) : size(n) { GRADSYNC_CUDA_CHECK(cudaMalloc(&data, n * sizeof(T))); }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    ~DeviceArray() { cudaFree(data); }
    void upload(const std::vector<T>& v) {
        GRADSYNC_CUDA_CHECK(cudaMemcpy(data, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
    [[nodiscard]] std::vector<T> download() const {
        std::vector<T> out(size);
        GRADSYNC_CUDA_CHECK(cudaMemcpy(out.data(), data, size * sizeof(T), cudaMemcpyDeviceToHost));
        return out;
    }
    T* data = nullptr;
    std::size_t size = 0;
};

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
std::vector<T> inputs_of(int rank, std::size_t count) {
    std::vector<T> v;
    for (std::size_t i = 0; i < count; ++i) v.push_back(T(float(int(i % 29) - 14) * 0.37f + float(rank) * 1.3f));
    return v;
}

// What each rank's buffer holds after `op` on LocalBackend, and after the same on NcclBackend.
struct Results {
    std::vector<std::vector<std::byte>> local, nccl;
};

template <class T, class Op>
Results both_backends(int n, std::size_t count, Op op) {
    Results out;
    out.local.resize(std::size_t(n));
    out.nccl.resize(std::size_t(n));
    const auto bytes_of = [](const std::vector<T>& v) {
        std::vector<std::byte> b(v.size() * sizeof(T));
        std::memcpy(b.data(), v.data(), b.size());
        return b;
    };
    gradsync::spawn(n, [&](gradsync::LocalBackend& backend) {
        auto data = inputs_of<T>(backend.rank(), count);
        op(backend, data.data(), count);
        out.local[std::size_t(backend.rank())] = bytes_of(data);
    });
    gradsync::nccl_spawn(n, [&](gradsync::NcclBackend<>& backend) {
        DeviceArray<T> data(count);
        data.upload(inputs_of<T>(backend.rank(), count));
        op(backend, data.data, count);
        out.nccl[std::size_t(backend.rank())] = bytes_of(data.download());
    });
    return out;
}

template <class T>
void check_collectives(int n, gradsync::DType dtype, std::size_t count) {
    CAPTURE(n);
    CAPTURE(count);
    const auto check = [&](const char* what, auto op, bool bitwise) {
        CAPTURE(what);
        const auto got = both_backends<T>(n, count, op);
        for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            CHECK(got.nccl[std::size_t(r)] == got.nccl[0]);  // every rank alike
            if (bitwise) CHECK(got.nccl[std::size_t(r)] == got.local[std::size_t(r)]);
        }
    };
    const bool power_of_two = (n & (n - 1)) == 0;
    check(
        "sum",
        [&](auto& b, T* p, std::size_t c) {
            b.allreduce(gradsync::Buffer{p, c, dtype});
        },
        true);
    check(
        "average",
        [&](auto& b, T* p, std::size_t c) {
            b.allreduce(gradsync::Buffer{p, c, dtype}, gradsync::ReduceOp::average);
        },
        power_of_two);
    check(
        "broadcast",
        [&](auto& b, T* p, std::size_t c) {
            b.broadcast(std::span<std::byte>(reinterpret_cast<std::byte*>(p), c * sizeof(T)), n - 1);
        },
        true);
    // reduce_scatter leaves this rank's shard reduced and the rest unspecified; the all_gather
    // after it makes every buffer whole.
    check(
        "reduce_scatter + all_gather",
        [&](auto& b, T* p, std::size_t c) {
            b.reduce_scatter(gradsync::Buffer{p, c, dtype});
            b.all_gather(gradsync::Buffer{p, c, dtype});
        },
        true);
}

// A model whose parameters and gradients lie in one device allocation each: contiguous, so each
// bucket is reduced where it lies.
struct DeviceModel {
    static constexpr std::size_t sizes[] = {1000, 3, 7001};
    static constexpr std::size_t total = 1000 + 3 + 7001;
    DeviceArray<float> weights{total}, grads{total};
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        std::size_t at = 0;
        for (std::size_t i = 0; i < 3; ++i) {
            out.push_back(
                {"p" + std::to_string(i), weights.data + at, grads.data + at, sizes[i], gradsync::DType::float32});
            at += sizes[i];
        }
        return out;
    }
};

// A host twin of DeviceModel, for LocalBackend.
struct HostModel {
    std::vector<float> weights = std::vector<float>(DeviceModel::total), grads = std::vector<float>(DeviceModel::total);
    std::vector<gradsync::Parameter> parameters() {
        std::vector<gradsync::Parameter> out;
        std::size_t at = 0;
        for (std::size_t i = 0; i < 3; ++i) {
            out.push_back({"p" + std::to_string(i), weights.data() + at, grads.data() + at, DeviceModel::sizes[i],
                           gradsync::DType::float32});
            at += DeviceModel::sizes[i];
        }
        return out;
    }
};

// This rank's gradient at `step` for weights `w`: a least-squares pull toward a rank's target.
std::vector<float> gradient_of(const std::vector<float>& w, int rank, int step) {
    std::vector<float> g(w.size());
    for (std::size_t i = 0; i < w.size(); ++i)
        g[i] = w[i] - (float(int(i % 23) - 11) * 0.05f + float(rank) * 0.3f + float(step) * 0.01f);
    return g;
}

constexpr int train_steps = 4;

// Trains `steps` SGD steps of the model on `n` ranks; returns each rank's final weights.
std::vector<std::vector<float>> train_local(int n) {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
    gradsync::spawn(n, [&](gradsync::LocalBackend& backend) {
        HostModel model;
        gradsync::DataParallel dp(model, backend);
        for (int step = 0; step < train_steps; ++step) {
            model.grads = gradient_of(model.weights, backend.rank(), step);
            dp.synchronize();
            for (std::size_t i = 0; i < model.weights.size(); ++i) model.weights[i] -= 0.5f * model.grads[i];
        }
        out[std::size_t(backend.rank())] = model.weights;
    });
    return out;
}

std::vector<std::vector<float>> train_nccl(int n) {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
    gradsync::nccl_spawn(n, [&](gradsync::NcclBackend<>& backend) {
        DeviceModel model;
        std::vector<float> weights(DeviceModel::total, 0.0f);
        model.weights.upload(weights);
        gradsync::DataParallel dp(model, backend);
        for (int step = 0; step < train_steps; ++step) {
            model.grads.upload(gradient_of(weights, backend.rank(), step));
            dp.synchronize();
            const auto grads = model.grads.download();  // on the default stream, after the reduction
            for (std::size_t i = 0; i < weights.size(); ++i) weights[i] -= 0.5f * grads[i];
            model.weights.upload(weights);
        }
        out[std::size_t(backend.rank())] = weights;
    });
    return out;
}

}  // namespace

TEST_CASE("NcclBackend on the stand-ins: 1 to 4 ranks reduce, broadcast, scatter and gather as LocalBackend does") {
    (void)standin::take_misuses();
    for (int n = 1; n <= 4; ++n) {
        check_collectives<float>(n, gradsync::DType::float32, 1001);
        check_collectives<double>(n, gradsync::DType::float64, 64);  // divisible by every n: one NCCL call
        check_collectives<gradsync::float16>(n, gradsync::DType::float16, 37);
        check_collectives<gradsync::bfloat16>(n, gradsync::DType::bfloat16, 5);
    }
    CHECK(standin::take_misuses().empty());
}

TEST_CASE("NcclBackend on the stand-ins: host buffers larger than the staging buffer go through it piece by piece") {
    (void)standin::take_misuses();
    const std::size_t count = gradsync::NcclBackend<>::staging_bytes / sizeof(double) * 2 + 7;  // three pieces
    std::vector<std::vector<double>> got(3);
    gradsync::nccl_spawn(3, [&](gradsync::NcclBackend<>& backend) {
        std::vector<double> data(count, double(backend.rank() + 1));
        backend.allreduce(gradsync::Buffer{data.data(), count, gradsync::DType::float64});
        got[std::size_t(backend.rank())] = data;
    });
    for (const auto& g : got) CHECK(g == std::vector<double>(count, 6.0));
    CHECK(standin::take_misuses().empty());
}

TEST_CASE("DataParallel<Model, NcclBackend> on the stand-ins: N ranks end with LocalBackend's parameters") {
    (void)standin::take_misuses();
    for (int polls : {1, 3}) {  // NCCL's "in progress", polled through once or three times per call
        standin::nccl_set_in_progress_polls(polls);
        for (int n = 1; n <= 4; ++n) {
            CAPTURE(n);
            const auto local = train_local(n);
            const auto nccl = train_nccl(n);
            for (int r = 0; r < n; ++r) {
                CAPTURE(r);
                CHECK(same_bytes(nccl[std::size_t(r)], nccl[0]));
                if ((n & (n - 1)) == 0) {
                    CHECK(same_bytes(nccl[std::size_t(r)], local[std::size_t(r)]));
                } else {  // NCCL's average pre-multiplies by 1/3; LocalBackend's multiplies the sum
                    for (std::size_t i = 0; i < local[0].size(); ++i)
                        REQUIRE(nccl[std::size_t(r)][i] == doctest::Approx(local[0][i]).epsilon(1e-5));
                }
            }
        }
    }
    standin::nccl_set_in_progress_polls(1);
    CHECK(standin::take_misuses().empty());
}

TEST_CASE("NcclBackend over a group split from another (ncclCommSplit) on the stand-ins: its ranks, sums and words") {
    (void)standin::take_misuses();
    std::vector<std::vector<float>> sums(4), from_root(4);
    std::vector<std::string> words(4);
    gradsync::nccl_spawn(4, [&](gradsync::NcclBackend<>& job) {
        const int me = job.rank();
        const auto slot = static_cast<std::size_t>(me);
        // By parity, as a data-parallel dimension beside a model one; numbered by job rank.
        gradsync::NcclBackend<> group(job, me % 2, me, {}, "shard " + std::to_string(me % 2));
        CHECK(group.size() == 2);
        CHECK(group.rank() == me / 2);
        CHECK(group.device() == job.device());
        CHECK(group.group().world_ranks == std::vector<int>{me % 2, me % 2 + 2});
        DeviceArray<float> data(100);
        data.upload(std::vector<float>(100, float(me + 1)));
        group.allreduce(gradsync::Buffer{data.data, 100, gradsync::DType::float32});
        sums[slot] = data.download();
        // The whole job again, numbered backwards by its key: rank 0 is job rank 3.
        gradsync::NcclBackend<> reversed(job, 0, -me);
        CHECK(reversed.rank() == 3 - me);
        CHECK(reversed.group().world_ranks == std::vector<int>{3, 2, 1, 0});
        std::vector<float> value = {float(me)};
        reversed.broadcast(std::span<float>(value), 0);
        from_root[slot] = value;
        try {
            group.broadcast(std::span<float>(value), 2);  // no rank 2 in a group of 2
        } catch (const gradsync::CollectiveError& e) {
            words[slot] = e.what();
        }
    });
    for (int r = 0; r < 4; ++r) {
        const auto slot = static_cast<std::size_t>(r);
        CHECK(sums[slot] == std::vector<float>(100, r % 2 == 0 ? 1.0f + 3.0f : 2.0f + 4.0f));
        CHECK(from_root[slot] == std::vector<float>{3.0f});
        CAPTURE(words[slot]);
        const std::string who = "gradsync: rank " + std::to_string(r / 2) + " of the group \"shard " +
                                std::to_string(r % 2) + "\" (job ranks " + std::to_string(r % 2) + ", " +
                                std::to_string(r % 2 + 2) + ") on NCCL, GPU ";
        CHECK(words[slot].rfind(who, 0) == 0);
    }
    CHECK(standin::take_misuses().empty());
}

TEST_CASE("NcclBackend split with a negative colour: refused on every rank, naming it") {
    std::vector<std::string> errors(2);
    gradsync::nccl_spawn(2, [&](gradsync::NcclBackend<>& job) {
        try {
            gradsync::NcclBackend<> group(job, -1, 0);
        } catch (const gradsync::Error& e) {
            errors[static_cast<std::size_t>(job.rank())] = e.what();
        }
    });
    for (const auto& e : errors) {
        CAPTURE(e);
        CHECK(e.find("a group's colour must be at least 0, got -1") != std::string::npos);
    }
}
