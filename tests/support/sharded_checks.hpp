// The reduce_scatter / all_gather contract, checked on any backend with the ShardedCollectives
// concept. Every rank computes every rank's input from a seed, so each checks its own shard (and,
// after the all_gather, the whole buffer) without a collective of its own. Every rank of the group
// calls the same checks in the same order.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/detail/host_reduce.hpp>  // for accumulator_t
#include <gradsync/buffer.hpp>
#include <gradsync/half.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

namespace sharded {

// Rank r's input: different per rank and element, reproducible from the seed.
template <class T>
std::vector<T> input_of(int rank, std::size_t n, std::uint64_t seed) {
    std::mt19937_64 rng(seed * 7919 + static_cast<std::uint64_t>(rank));
    std::uniform_real_distribution<double> d(-1.0, 1.0);
    std::vector<T> v(n);
    for (auto& x : v) x = T(static_cast<float>(d(rng)));
    return v;
}

// The reduction in rank order, in the accumulator type, times 1/n for an average, rounded once.
template <class T>
std::vector<T> reduced(int world, std::size_t n, std::uint64_t seed, gradsync::ReduceOp op) {
    using A = gradsync::detail::accumulator_t<T>;
    std::vector<A> sum(n, A(0));
    for (int r = 0; r < world; ++r) {
        const auto in = input_of<T>(r, n, seed);
        for (std::size_t i = 0; i < n; ++i) sum[i] += static_cast<A>(in[i]);
    }
    std::vector<T> out(n);
    for (std::size_t i = 0; i < n; ++i)
        out[i] = T(op == gradsync::ReduceOp::average && world > 1 ? sum[i] * (A(1) / static_cast<A>(world)) : sum[i]);
    return out;
}

// How far a backend that sums in another order may be from the rank-ordered sum: a few units in
// the last place of T per rank, on inputs in [-1, 1].
template <class T>
double tolerance(int world) {
    double eps = std::numeric_limits<float>::epsilon();
    if constexpr (std::is_same_v<T, double>) eps = std::numeric_limits<double>::epsilon();
    if constexpr (std::is_same_v<T, gradsync::float16>) eps = 1.0 / 1024;
    if constexpr (std::is_same_v<T, gradsync::bfloat16>) eps = 1.0 / 128;
    return 4 * eps * world;
}

// Elements [begin, end) of `got` against `want`: bitwise when `exact`, else within tolerance.
template <class T>
void check_range(const std::vector<T>& got, const std::vector<T>& want, std::size_t begin, std::size_t end, bool exact,
                 int world) {
    std::size_t wrong = 0, first = end;
    for (std::size_t i = begin; i < end; ++i) {
        const bool ok = exact ? std::memcmp(&got[i], &want[i], sizeof(T)) == 0
                              : std::abs(static_cast<double>(static_cast<float>(got[i])) -
                                         static_cast<double>(static_cast<float>(want[i]))) <= tolerance<T>(world);
        if (!ok && wrong++ == 0) first = i;
    }
    CAPTURE(first);
    CHECK(wrong == 0);
}

// One reduce_scatter of n elements, then the all_gather that completes it: this rank's shard holds
// the reduction after the first, the whole buffer after the second (the allreduce's result). With
// `exact`, both are bitwise the rank-ordered reduction. Synchronous and asynchronous alike.
template <class T, class B>
void reduce_scatter_then_all_gather(B& b, std::size_t n, gradsync::ReduceOp op, std::uint64_t seed, bool exact,
                                    bool async) {
    static_assert(gradsync::ShardedCollectives<B>);
    const int world = b.size(), rank = b.rank();
    CAPTURE(world);
    CAPTURE(rank);
    CAPTURE(n);
    CAPTURE(gradsync::to_string(gradsync::dtype_of<T>));
    CAPTURE(async);
    auto v = input_of<T>(rank, n, seed);
    const auto want = reduced<T>(world, n, seed, op);
    if (async)
        b.reduce_scatter_async(gradsync::buffer_of(std::span<T>(v)), op).wait();
    else
        b.reduce_scatter(gradsync::buffer_of(std::span<T>(v)), op);
    const auto mine = gradsync::shard_of(n, world, rank);
    check_range(v, want, mine.offset, mine.offset + mine.count, exact, world);
    // Everything but the shard is unspecified now; the all_gather must fill it all.
    for (std::size_t i = 0; i < n; ++i)
        if (i < mine.offset || i >= mine.offset + mine.count) v[i] = T(12345.0f);
    if (async)
        b.all_gather_async(gradsync::buffer_of(std::span<T>(v))).wait();
    else
        b.all_gather(gradsync::buffer_of(std::span<T>(v)));
    check_range(v, want, 0, n, exact, world);
}

// The contract over sizes that do and do not divide by the group (and below it, and zero), every
// dtype, both ops.
template <class B>
void check_contract(B& b, bool exact) {
    const std::size_t counts[] = {0, 1, 2, 3, 7, 64, 1000, 4099, 65537};
    std::uint64_t seed = 1;
    for (auto n : counts) {
        for (bool async : {false, true}) {
            reduce_scatter_then_all_gather<float>(b, n, gradsync::ReduceOp::sum, ++seed, exact, async);
            reduce_scatter_then_all_gather<double>(b, n, gradsync::ReduceOp::average, ++seed, exact, async);
            reduce_scatter_then_all_gather<gradsync::float16>(b, n, gradsync::ReduceOp::average, ++seed, exact, async);
            reduce_scatter_then_all_gather<gradsync::bfloat16>(b, n, gradsync::ReduceOp::sum, ++seed, exact, async);
        }
    }
}

}  // namespace sharded
