// The walk that the one-launch pack and unpack kernels (cuda/pack.cuh) run in every block,
// checked here on the host: every element of the bucket comes from exactly one tensor element,
// in order, whatever the tile size and the tensors' sizes (0, 1, many small, one huge, gaps).
#include <doctest/doctest.h>

#include <gradsync/memory/cuda/bucket_table.hpp>

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace {

using gradsync::cuda::Segment;

struct Layout {
    std::vector<std::vector<std::uint32_t>> tensors;  // element values name their origin
    std::vector<Segment> table;
    std::uint64_t total = 0;
};

// Tensors of the given sizes, laid out in order with `gap` unused elements after each.
Layout make_layout(const std::vector<std::uint64_t>& sizes, std::uint64_t gap = 0) {
    Layout l;
    std::uint32_t next = 1;
    for (auto n : sizes) {
        l.tensors.emplace_back(n);
        std::iota(l.tensors.back().begin(), l.tensors.back().end(), next);
        next += std::uint32_t(n);
    }
    for (auto& t : l.tensors) {
        l.table.push_back(Segment{t.data(), t.size(), l.total});
        l.total += t.size() + gap;
    }
    return l;
}

// Packs as the kernel does, one tile per "block", and counts the writes to every element.
std::vector<std::uint32_t> pack_by_tiles(const Layout& l, std::uint64_t tile, std::vector<int>& writes) {
    std::vector<std::uint32_t> bucket(l.total, 0);
    writes.assign(l.total, 0);
    for (std::uint64_t begin = 0; begin < l.total; begin += tile) {
        const std::uint64_t end = std::min(begin + tile, l.total);
        gradsync::cuda::for_each_piece(
            l.table.data(), l.table.size(), begin, end,
            [&](std::size_t s, std::uint64_t in_tensor, std::uint64_t in_bucket, std::uint64_t n) {
                REQUIRE(in_bucket >= begin);
                REQUIRE(in_bucket + n <= end);
                REQUIRE(in_tensor + n <= l.table[s].count);
                const auto* src = static_cast<const std::uint32_t*>(l.table[s].data);
                for (std::uint64_t i = 0; i < n; ++i) {
                    bucket[in_bucket + i] = src[in_tensor + i];
                    ++writes[in_bucket + i];
                }
            });
    }
    return bucket;
}

std::vector<std::uint32_t> pack_reference(const Layout& l) {
    std::vector<std::uint32_t> bucket(l.total, 0);
    for (std::size_t s = 0; s < l.tensors.size(); ++s)
        std::copy(l.tensors[s].begin(), l.tensors[s].end(), bucket.begin() + std::ptrdiff_t(l.table[s].offset));
    return bucket;
}

void check_layout(const Layout& l, std::uint64_t gap) {
    for (std::uint64_t tile : {1, 2, 3, 7, 64, 8192, 1 << 20}) {
        CAPTURE(tile);
        std::vector<int> writes;
        const auto bucket = pack_by_tiles(l, tile, writes);
        CHECK(bucket == pack_reference(l));
        // Tensor elements are written once each; the gaps between tensors never.
        std::uint64_t written = 0;
        for (int w : writes) {
            CHECK(w <= 1);
            written += std::uint64_t(w);
        }
        CHECK(written == l.total - gap * l.tensors.size());
    }
}

}  // namespace

TEST_CASE("bucket table walk: awkward tensor sizes, any tile, every element exactly once") {
    check_layout(make_layout({}), 0);
    check_layout(make_layout({0}), 0);
    check_layout(make_layout({1}), 0);
    check_layout(make_layout({0, 0, 5, 0, 3, 0}), 0);
    check_layout(make_layout({1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}), 0);
    check_layout(make_layout({8191, 8192, 8193, 1, 70000}), 0);
    check_layout(make_layout({3, 0, 17, 5}, /*gap=*/2), 2);
}

TEST_CASE("bucket table walk: the ResNet-50-like mix of many small and a few large tensors") {
    std::mt19937 rng(5);
    std::vector<std::uint64_t> sizes;
    for (int i = 0; i < 161; ++i) sizes.push_back(i % 10 == 0 ? 20000 + rng() % 50000 : rng() % 600);
    check_layout(make_layout(sizes), 0);
}

TEST_CASE("bucket table walk: segment_at finds the tensor holding a position") {
    const auto l = make_layout({4, 0, 0, 6, 1});
    CHECK(gradsync::cuda::segment_at(l.table.data(), l.table.size(), 0) == 0);
    CHECK(gradsync::cuda::segment_at(l.table.data(), l.table.size(), 3) == 0);
    CHECK(gradsync::cuda::segment_at(l.table.data(), l.table.size(), 4) == 3);  // past the empty ones
    CHECK(gradsync::cuda::segment_at(l.table.data(), l.table.size(), 9) == 3);
    CHECK(gradsync::cuda::segment_at(l.table.data(), l.table.size(), 10) == 4);
    CHECK(gradsync::cuda::segment_at(l.table.data(), 0, 10) == 0);
}
