// LocalBackend: allreduce, broadcast and barrier among threads, both algorithms, every world
// size from 1 to 8, and the failures that must become exceptions rather than hangs.
#include <gradsync/backend/local.hpp>
#include <gradsync/half.hpp>
#include <gradsync/launch/spawn.hpp>

#include <doctest/doctest.h>

#include "support/generic_trainer.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace gradsync::literals;
using gradsync::LocalAlgorithm;
using gradsync::LocalBackend;
using gradsync::LocalGroupOptions;
using gradsync::ReduceOp;
using gradsync::Segment;

namespace {

LocalGroupOptions with_algorithm(LocalAlgorithm a) {
    LocalGroupOptions o;
    o.algorithm = a;
    o.one_shot_max = 4_KiB;  // small, so that one-shot runs in many pieces on larger inputs
    return o;
}

constexpr LocalAlgorithm all_algorithms[] = {LocalAlgorithm::automatic, LocalAlgorithm::one_shot,
                                             LocalAlgorithm::reduce_scatter_all_gather};

// Random input of rank r: different per rank and element, reproducible.
template <class T>
std::vector<T> input_of(int rank, std::size_t n, std::uint64_t seed) {
    std::mt19937_64 rng(seed * 1000 + static_cast<std::uint64_t>(rank));
    std::uniform_real_distribution<double> d(-1.0, 1.0);
    std::vector<T> v(n);
    for (auto& x : v) x = T(static_cast<float>(d(rng)));
    return v;
}

// The documented result: the sum in rank order, in float for the 16-bit types, times 1/n for an
// average, rounded to the storage type once.
template <class T>
std::vector<T> expected(int world, std::size_t n, std::uint64_t seed, ReduceOp op) {
    using A = gradsync::detail::accumulator_t<T>;
    std::vector<std::vector<T>> in;
    for (int r = 0; r < world; ++r) in.push_back(input_of<T>(r, n, seed));
    std::vector<T> out(n);
    for (std::size_t i = 0; i < n; ++i) {
        A s = static_cast<A>(in[0][i]);
        for (int r = 1; r < world; ++r) s += static_cast<A>(in[static_cast<std::size_t>(r)][i]);
        out[i] = T(op == ReduceOp::average && world > 1 ? s * (A(1) / static_cast<A>(world)) : s);
    }
    return out;
}

template <class T>
void check_allreduce(int world, std::size_t n, LocalAlgorithm algo, ReduceOp op) {
    const std::uint64_t seed = n * 31 + static_cast<std::uint64_t>(world);
    auto want = expected<T>(world, n, seed, op);
    std::vector<std::vector<T>> results(static_cast<std::size_t>(world));
    gradsync::spawn(
        world,
        [&](LocalBackend& b) {
            auto v = input_of<T>(b.rank(), n, seed);
            b.allreduce(std::span<T>(v), op);
            results[static_cast<std::size_t>(b.rank())] = std::move(v);
        },
        with_algorithm(algo));
    for (int r = 0; r < world; ++r) {
        // Bitwise: every rank, every algorithm, the documented summation order.
        const auto& got = results[static_cast<std::size_t>(r)];
        REQUIRE(got.size() == n);
        CHECK((n == 0 || std::memcmp(got.data(), want.data(), n * sizeof(T)) == 0));  // memcmp(nullptr, ...) is UB
    }
}

}  // namespace

TEST_CASE("allreduce is bitwise the rank-ordered sum, for world sizes 1 to 8, both algorithms, every dtype") {
    const std::size_t counts[] = {0, 1, 2, 15, 16, 17, 1000, 1023, 4097, 65537};
    for (int world = 1; world <= 8; ++world) {
        for (auto algo : all_algorithms) {
            for (auto n : counts) {
                CAPTURE(world);
                CAPTURE(static_cast<int>(algo));
                CAPTURE(n);
                check_allreduce<float>(world, n, algo, ReduceOp::sum);
                check_allreduce<double>(world, n, algo, ReduceOp::average);
                check_allreduce<gradsync::float16>(world, n, algo, ReduceOp::average);
                check_allreduce<gradsync::bfloat16>(world, n, algo, ReduceOp::sum);
            }
        }
    }
}

TEST_CASE("allreduce of tens of millions of elements, not divisible by the world size") {
    const std::size_t n = 20'000'003;
    for (int world : {2, 3}) {
        for (auto algo : {LocalAlgorithm::one_shot, LocalAlgorithm::reduce_scatter_all_gather}) {
            CAPTURE(world);
            CAPTURE(static_cast<int>(algo));
            // Small integers sum exactly, so the expected value is known without a reference run.
            std::vector<int> bad(static_cast<std::size_t>(world), -1);
            gradsync::spawn(
                world,
                [&](LocalBackend& b) {
                    std::vector<float> v(n);
                    for (std::size_t i = 0; i < n; ++i)
                        v[i] = static_cast<float>((i % 1000) + 1000 * static_cast<std::size_t>(b.rank()));
                    b.allreduce(std::span<float>(v), ReduceOp::sum);
                    const float ranks_part = 1000.0f * static_cast<float>(world * (world - 1) / 2);
                    int first_bad = -1;
                    for (std::size_t i = 0; i < n && first_bad < 0; ++i) {
                        if (v[i] != static_cast<float>(world) * static_cast<float>(i % 1000) + ranks_part)
                            first_bad = static_cast<int>(i);
                    }
                    bad[static_cast<std::size_t>(b.rank())] = first_bad;
                },
                with_algorithm(algo));
            for (int r = 0; r < world; ++r) CHECK(bad[static_cast<std::size_t>(r)] == -1);
        }
    }
}

TEST_CASE("both algorithms give the same bits") {
    const std::size_t n = 50'001;
    std::vector<std::vector<float>> by_algo;
    for (auto algo : {LocalAlgorithm::one_shot, LocalAlgorithm::reduce_scatter_all_gather}) {
        std::vector<float> rank0;
        gradsync::spawn(
            3,
            [&](LocalBackend& b) {
                auto v = input_of<float>(b.rank(), n, 5);
                b.allreduce(std::span<float>(v), ReduceOp::average);
                if (b.rank() == 0) rank0 = v;
            },
            with_algorithm(algo));
        by_algo.push_back(rank0);
    }
    CHECK(std::memcmp(by_algo[0].data(), by_algo[1].data(), n * sizeof(float)) == 0);
}

TEST_CASE("scattered allreduce reduces segments where they lie, like one contiguous buffer") {
    // Segment sizes with empty segments and sizes that straddle block and chunk boundaries.
    const std::size_t sizes[] = {3, 0, 2048, 1, 0, 5000, 17, 64, 0, 9000, 2};
    std::size_t total = 0;
    for (auto s : sizes) total += s;
    for (auto algo : all_algorithms) {
        for (int world : {1, 2, 3, 4}) {
            CAPTURE(world);
            CAPTURE(static_cast<int>(algo));
            auto want = expected<double>(world, total, 11, ReduceOp::average);
            std::vector<int> mismatches(static_cast<std::size_t>(world), -1);
            gradsync::spawn(
                world,
                [&](LocalBackend& b) {
                    auto flat = input_of<double>(b.rank(), total, 11);
                    // Scatter the input over separately allocated tensors.
                    std::vector<std::vector<double>> tensors;
                    std::vector<Segment> segs;
                    std::size_t off = 0;
                    for (auto s : sizes) {
                        tensors.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(off),
                                             flat.begin() + static_cast<std::ptrdiff_t>(off + s));
                        off += s;
                    }
                    for (auto& t : tensors) segs.push_back(Segment{t.data(), t.size()});
                    b.allreduce(std::span<const Segment>(segs), gradsync::DType::float64, ReduceOp::average);
                    int bad = 0;
                    off = 0;
                    for (const auto& t : tensors)
                        for (double x : t) bad += x != want[off++];
                    mismatches[static_cast<std::size_t>(b.rank())] = bad;
                },
                with_algorithm(algo));
            for (auto m : mismatches) CHECK(m == 0);
        }
    }
}

TEST_CASE("broadcast copies the root's bytes to every rank") {
    for (int world : {1, 2, 3, 5}) {
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{4096}, std::size_t{1} << 20}) {
            for (int root = 0; root < world; ++root) {
                std::atomic<int> wrong{0};
                gradsync::spawn(world, [&](LocalBackend& b) {
                    std::vector<std::uint8_t> v(n, static_cast<std::uint8_t>(b.rank() + 1));
                    if (b.rank() == root)
                        for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(i * 7 + 3);
                    b.broadcast(std::span<std::uint8_t>(v), root);
                    for (std::size_t i = 0; i < n; ++i)
                        if (v[i] != static_cast<std::uint8_t>(i * 7 + 3)) {
                            ++wrong;
                            break;
                        }
                });
                CHECK(wrong.load() == 0);
            }
        }
    }
}

TEST_CASE("barrier: nobody leaves before everybody arrived") {
    for (int world : {2, 4, 7}) {
        std::atomic<int> arrived{0};
        std::atomic<int> early{0};
        gradsync::spawn(world, [&](LocalBackend& b) {
            for (int round = 1; round <= 20; ++round) {
                if (b.rank() == round % world) std::this_thread::sleep_for(std::chrono::microseconds(200));
                arrived.fetch_add(1);
                b.barrier();
                if (arrived.load() < round * world) early.fetch_add(1);
                b.barrier();
            }
        });
        CHECK(early.load() == 0);
        CHECK(arrived.load() == 20 * world);
    }
}

TEST_CASE("asynchronous collectives complete in launch order and mix with synchronous ones") {
    for (int world : {1, 2, 3}) {
        std::atomic<int> wrong{0};
        gradsync::spawn(world, [&](LocalBackend& b) {
            std::vector<std::vector<float>> bufs;
            for (int k = 0; k < 6; ++k)
                bufs.emplace_back(1000u + 5000u * static_cast<unsigned>(k), float(k + b.rank()));
            std::vector<gradsync::CollectiveHandle> handles;
            for (auto& v : bufs) handles.push_back(b.allreduce_async(std::span<float>(v), ReduceOp::sum));
            std::vector<double> extra{double(b.rank())};
            b.allreduce(std::span<double>(extra), ReduceOp::sum);  // waits for the asynchronous ones first
            CHECK(handles.back().ready());
            for (auto& h : handles) h.wait();
            const float ranks_sum = float(world * (world - 1) / 2);
            for (int k = 0; k < 6; ++k)
                for (float x : bufs[static_cast<std::size_t>(k)])
                    if (x != float(k * world) + ranks_sum) {
                        ++wrong;
                        break;
                    }
            if (extra[0] != double(world * (world - 1) / 2)) ++wrong;
        });
        CHECK(wrong.load() == 0);
    }
    gradsync::CollectiveHandle none;
    CHECK(none.ready());
    none.wait();
}

TEST_CASE("ranks that call different collectives all get the same error, not a hang") {
    std::vector<std::string> messages(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        std::vector<float> v(100);
        try {
            if (b.rank() == 0)
                b.allreduce(std::span<float>(v), ReduceOp::sum);
            else
                b.broadcast(std::span<float>(v), 0);
        } catch (const gradsync::CollectiveError& e) {
            messages[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& m : messages) {
        CHECK(m.find("collective mismatch: rank 0 is in allreduce #1 of 100 x float32 (400 B), sum but rank 1 is in "
                     "broadcast #1 of 400 B from rank 0") != std::string::npos);
    }

    // Same kind, different sizes.
    std::vector<std::string> sizes(3);
    gradsync::spawn(3, [&](LocalBackend& b) {
        std::vector<double> v(b.rank() == 2 ? 7 : 8);
        try {
            b.allreduce(std::span<double>(v), ReduceOp::average);
        } catch (const gradsync::CollectiveError& e) {
            sizes[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& m : sizes)
        CHECK(m.find("rank 2 is in allreduce #1 of 7 x float64 (56 B), average") != std::string::npos);
}

TEST_CASE("a rank that leaves the group fails its peers at once, not at the deadline") {
    std::string message;
    auto start = std::chrono::steady_clock::now();
    gradsync::spawn(2, [&](LocalBackend& b) {
        if (b.rank() == 1) return;  // forgets the collective
        std::vector<float> v(10);
        try {
            b.allreduce(std::span<float>(v), ReduceOp::sum);
        } catch (const gradsync::CollectiveError& e) {
            message = e.what();
        }
    });
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));  // the deadline is 600 s
    CHECK(message.find("rank 0, allreduce #1 of 10 x float32 (40 B), sum: rank 1 left the group") != std::string::npos);
}

TEST_CASE("a rank that never arrives makes the others time out with a diagnosis") {
    LocalGroupOptions opts;
    opts.timeout = std::chrono::milliseconds(200);
    std::vector<std::string> messages(3);
    std::atomic<bool> timed_out_first{false};
    gradsync::spawn(
        3,
        [&](LocalBackend& b) {
            std::vector<float> v(10);
            if (b.rank() == 2) {
                std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            }
            try {
                b.allreduce(std::span<float>(v), ReduceOp::sum);
            } catch (const gradsync::TimeoutError& e) {
                timed_out_first = true;
                messages[static_cast<std::size_t>(b.rank())] = e.what();
            } catch (const gradsync::CollectiveError& e) {
                messages[static_cast<std::size_t>(b.rank())] = e.what();
            }
        },
        opts);
    CHECK(timed_out_first.load());
    for (const auto& m : messages) {
        CAPTURE(m);
        CHECK(m.find("timed out after 200 ms waiting for rank 2, which has entered 0 collectives") !=
              std::string::npos);
    }
}

TEST_CASE("spawn's abort releases ranks blocked in a collective") {
    std::vector<std::string> messages(4);
    CHECK_THROWS_WITH_AS(gradsync::spawn(4,
                                         [&](LocalBackend& b) {
                                             if (b.rank() == 3) throw std::runtime_error("out of memory on rank 3");
                                             std::vector<float> v(10);
                                             try {
                                                 b.allreduce(std::span<float>(v), ReduceOp::sum);
                                             } catch (const gradsync::CollectiveError& e) {
                                                 messages[static_cast<std::size_t>(b.rank())] = e.what();
                                             }
                                         }),
                         "out of memory on rank 3", std::runtime_error);
    for (int r = 0; r < 3; ++r) {
        CAPTURE(messages[static_cast<std::size_t>(r)]);
        CHECK(messages[static_cast<std::size_t>(r)].find("rank 3 threw: out of memory on rank 3") != std::string::npos);
    }
}

TEST_CASE("bad arguments fail every rank") {
    std::vector<std::string> messages(2);
    gradsync::spawn(2, [&](LocalBackend& b) {
        std::vector<float> v(4);
        try {
            b.broadcast(std::span<float>(v), 5);
        } catch (const gradsync::CollectiveError& e) {
            messages[static_cast<std::size_t>(b.rank())] = e.what();
        }
    });
    for (const auto& m : messages) CHECK(m.find("root 5 is not a rank of this group of 2") != std::string::npos);

    gradsync::spawn(2, [&](LocalBackend& b) {
        std::int32_t counters[4] = {};
        CHECK_THROWS_WITH_AS(b.allreduce(gradsync::Buffer{counters, 4, gradsync::DType::int32}, ReduceOp::sum),
                             doctest::Contains("LocalBackend reduces floating-point types only, not int32"),
                             gradsync::CollectiveError);
    });

    CHECK_THROWS_WITH_AS(LocalBackend::create_group(0), doctest::Contains("at least 1 rank"), gradsync::Error);
}

TEST_CASE("a group reports its memory and its ranks") {
    auto ranks = LocalBackend::create_group(3);
    REQUIRE(ranks.size() == 3);
    CHECK(ranks[2].rank() == 2);
    CHECK(ranks[0].size() == 3);
    CHECK(ranks[0].supports(gradsync::DType::float64));
    CHECK(ranks[0].supports(gradsync::DType::bfloat16));
    CHECK_FALSE(ranks[0].supports(gradsync::DType::int64));
    CHECK(ranks[0].memory_footprint() == 2 * 4_KiB + 8_KiB);  // the staging slot is at least 4 KiB
}

TEST_CASE("a trainer's collective calls, written once for every backend, run on LocalBackend") {
    gradsync::spawn(3, [](gradsync::LocalBackend& backend) {
        const auto r = static_cast<float>(backend.rank());
        std::vector<float> grads(5, r + 1);  // 1, 2, 3: sum 6, then average 6
        std::vector<double> stats(2, 2.0 * r);
        std::vector<gradsync::float16> halves(4, gradsync::float16(r));
        std::vector<std::int64_t> seeds(3, 100 + backend.rank());
        generic::collective_step(backend, std::span(grads), std::span(stats), std::span(halves), std::span(seeds));
        for (float g : grads) CHECK(g == 6.0f);
        for (double s : stats) CHECK(s == 2.0);
        for (auto h : halves) CHECK(static_cast<float>(h) == 1.0f);
        for (auto s : seeds) CHECK(s == 100);
    });
}
