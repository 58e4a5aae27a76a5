// GroupLabel: which ranks of the whole job a backend's group holds. A backend over a subset of
// the job (one data-parallel dimension of a larger one, the ranks of one machine) names its
// group and those ranks in every message, so that "rank 1" is never ambiguous.
#pragma once

#include <gradsync/error.hpp>

#include <cstddef>
#include <string>
#include <utility>  // for std::move
#include <vector>

namespace gradsync::inline v0 {

struct GroupLabel {
    std::string name;              // the trainer's name for the group; may be empty
    std::vector<int> world_ranks;  // the job rank of each group rank; empty: the group is the whole job

    [[nodiscard]] bool whole_job() const { return world_ranks.empty(); }

    // "the group "dp 1" (job ranks 2, 3)", or "the group of job ranks 2, 3"; "" for the whole job.
    [[nodiscard]] std::string describe() const {
        if (whole_job()) return {};
        std::string ranks;
        const std::size_t shown = world_ranks.size() <= 8 ? world_ranks.size() : 6;
        for (std::size_t i = 0; i < shown; ++i) ranks += (i ? ", " : "") + std::to_string(world_ranks[i]);
        if (shown < world_ranks.size())
            ranks +=
                ", ... " + std::to_string(world_ranks.back()) + " (" + std::to_string(world_ranks.size()) + " ranks)";
        return name.empty() ? "the group of job ranks " + ranks
                            : "the group \"" + name + "\" (job ranks " + ranks + ")";
    }

    // How a message about group rank `rank` begins: "gradsync: rank 1 of the group "dp 1" (job
    // ranks 2, 3)"; for the whole job as before, "gradsync: rank 3".
    [[nodiscard]] std::string who(int rank) const {
        return whole_job() ? detail::rank_prefix(rank) : detail::rank_prefix(rank) + " of " + describe();
    }
    // ...and with the group's size for the whole job: "gradsync: rank 3 of 4".
    [[nodiscard]] std::string who(int rank, int size) const {
        return whole_job() ? detail::rank_prefix(rank, size) : who(rank);
    }
};

// A label for the group of `world_ranks` (in group rank order), or the whole job's when they are
// 0, 1, ... size - 1 of a job of that size.
inline GroupLabel group_label(std::string name, std::vector<int> world_ranks, int world_size) {
    bool whole = static_cast<int>(world_ranks.size()) == world_size;
    for (std::size_t i = 0; whole && i < world_ranks.size(); ++i) whole = world_ranks[i] == static_cast<int>(i);
    if (whole) return {std::move(name), {}};
    return {std::move(name), std::move(world_ranks)};
}

namespace detail {

// How a message about `backend`'s rank begins: its group's words where it names one.
template <class Backend>
std::string who(const Backend& backend) {
    if constexpr (requires { backend.group(); })
        return backend.group().who(backend.rank());
    else
        return rank_prefix(backend.rank());
}

}  // namespace detail

}  // namespace gradsync::inline v0
