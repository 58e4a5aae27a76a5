// A job of nodes x ranks-per-node threads, each with a TwoLevelBackend over LocalBackend groups
// playing its node and its place across the nodes, numbered node by node.
#pragma once

#include <gradsync/backend/local.hpp>
#include <gradsync/backend/two_level.hpp>
#include <gradsync/launch/spawn.hpp>

#include <cstddef>
#include <vector>

namespace gradsync_test {

using TwoLevel = gradsync::TwoLevelBackend<gradsync::LocalBackend, gradsync::LocalBackend>;

// fn(backend) on each rank.
template <class Fn>
void run_two_level(int nodes, int per_node, const Fn& fn, gradsync::LocalGroupOptions options = {}) {
    const int n = nodes * per_node;
    std::vector<int> node_of(static_cast<std::size_t>(n)), place_of(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
        node_of[static_cast<std::size_t>(r)] = r / per_node;
        place_of[static_cast<std::size_t>(r)] = r % per_node;
    }
    auto node = gradsync::LocalBackend::split(node_of, options);
    auto across = gradsync::LocalBackend::split(place_of, options);
    gradsync::spawn(n, [&](gradsync::LocalBackend& job) {
        const auto me = static_cast<std::size_t>(job.rank());
        TwoLevel backend(node[me], across[me]);
        fn(backend);
    });
}

}  // namespace gradsync_test
