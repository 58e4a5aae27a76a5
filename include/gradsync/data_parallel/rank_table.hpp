// RankTable: a few unsigned 64-bit numbers from every rank, gathered on every rank by one
// allreduce. Each rank writes only its own row of a table of doubles, each number as two 32-bit
// halves (exact in a double), so the sum over ranks is every rank's row, bit for bit, on any
// backend that sums doubles.
#pragma once

#include <gradsync/backend/concepts.hpp>
#include <gradsync/buffer.hpp>
#include <gradsync/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradsync::inline v0::detail {

class RankTable {
public:
    RankTable(int world, int rank, std::size_t columns)
        : rank_(rank), columns_(columns), cells_(static_cast<std::size_t>(world) * columns * 2, 0.0) {}

    // Sets a number of this rank's row.
    void set(std::size_t column, std::uint64_t value) {
        double* cell = cells_.data() + index(rank_, column);
        cell[0] = static_cast<double>(value >> 32);
        cell[1] = static_cast<double>(value & 0xffffffffu);
    }

    // Collective: afterwards every rank holds every rank's row.
    template <Backend B>
    void gather(B& backend) {
        backend.allreduce(Buffer{cells_.data(), cells_.size(), DType::float64}, ReduceOp::sum);
    }

    [[nodiscard]] std::uint64_t at(int rank, std::size_t column) const {
        const double* cell = cells_.data() + index(rank, column);
        return (static_cast<std::uint64_t>(cell[0]) << 32) | static_cast<std::uint64_t>(cell[1]);
    }
    [[nodiscard]] bool same_as_rank0(int rank, std::size_t column) const { return at(rank, column) == at(0, column); }

private:
    [[nodiscard]] std::size_t index(int rank, std::size_t column) const {
        return (static_cast<std::size_t>(rank) * columns_ + column) * 2;
    }

    int rank_;
    std::size_t columns_;
    std::vector<double> cells_;
};

}  // namespace gradsync::inline v0::detail
