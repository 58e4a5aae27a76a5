// ShardedSampler: each rank's share of a dataset's indices for an epoch, shuffled the same way on
// every rank from a seed, and the same number of them on every rank: uneven batch counts are the
// classic data-parallel deadlock (one rank stops calling synchronize() before the others).
#pragma once

#include <gradsync/error.hpp>

#include <cstddef>
#include <cstdint>
#include <numeric>  // for std::iota
#include <string>
#include <utility>  // for std::swap
#include <vector>

namespace gradsync::inline v0 {

// What to do when the dataset does not divide by the world size.
enum class SamplerTail : unsigned char {
    pad,   // repeat indices from the start until it does: every example is seen
    drop,  // leave out the last few: no example is seen twice
};

class ShardedSampler {
public:
    struct Options {
        std::uint64_t seed = 0;
        bool shuffle = true;
        SamplerTail tail = SamplerTail::pad;
    };

    ShardedSampler(std::size_t dataset_size, int world_size, int rank, Options options)
        : size_(dataset_size), world_(world_size), rank_(rank), options_(options) {
        if (world_size < 1 || rank < 0 || rank >= world_size)
            throw Error("gradsync: ShardedSampler needs 0 <= rank < world size, got rank " + std::to_string(rank) +
                        " of " + std::to_string(world_size));
    }
    ShardedSampler(std::size_t dataset_size, int world_size, int rank)
        : ShardedSampler(dataset_size, world_size, rank, Options{}) {}

    // A new order per epoch: call it before each epoch, with the same epoch on every rank.
    void set_epoch(std::uint64_t epoch) { epoch_ = epoch; }
    [[nodiscard]] std::uint64_t epoch() const { return epoch_; }
    // The shuffle's seed, as a checkpoint restores it; the same on every rank.
    void set_seed(std::uint64_t seed) { options_.seed = seed; }
    [[nodiscard]] const Options& options() const { return options_; }

    // Indices per rank and epoch: the same on every rank.
    [[nodiscard]] std::size_t size() const {
        const auto w = static_cast<std::size_t>(world_);
        return options_.tail == SamplerTail::pad ? (size_ + w - 1) / w : size_ / w;
    }

    // Batches per rank and epoch, the same on every rank; a last, shorter batch counts unless
    // drop_last.
    [[nodiscard]] std::size_t batches(std::size_t batch_size, bool drop_last = false) const {
        if (batch_size == 0) throw Error("gradsync: ShardedSampler::batches needs a batch size above 0");
        return drop_last ? size() / batch_size : (size() + batch_size - 1) / batch_size;
    }

    // This rank's indices for the current epoch: every world_size-th of the epoch's order.
    [[nodiscard]] std::vector<std::size_t> indices() const {
        std::vector<std::size_t> order(size_);
        std::iota(order.begin(), order.end(), std::size_t{0});
        if (options_.shuffle) shuffle(order);
        const std::size_t total = size() * static_cast<std::size_t>(world_);
        std::vector<std::size_t> mine;
        mine.reserve(size());
        for (std::size_t k = static_cast<std::size_t>(rank_); k < total; k += static_cast<std::size_t>(world_))
            mine.push_back(order[k % size_]);  // past the end: the padding wraps around
        return mine;
    }

private:
    // Fisher-Yates with splitmix64, so that the order is the same on every platform and library.
    void shuffle(std::vector<std::size_t>& v) const {
        std::uint64_t state = options_.seed * 0x9e3779b97f4a7c15ull + epoch_ + 1;
        auto next = [&state] {
            std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
            return z ^ (z >> 31);
        };
        for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next() % i]);
    }

    std::size_t size_;
    int world_;
    int rank_;
    Options options_;
    std::uint64_t epoch_ = 0;
};

}  // namespace gradsync::inline v0
