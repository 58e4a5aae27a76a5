// Groups of some of the job's ranks as MPI communicators: MpiComm (one the program owns),
// mpi_split (any colour), mpi_node_comm (the ranks of this machine) and mpi_cross_node_comm (this
// rank's peers on the other machines). An MpiBackend over one is a backend of that group only.
#pragma once

#include <gradsync/backend/group_label.hpp>
#include <gradsync/backend/mpi/mpi_api.hpp>
#include <gradsync/backend/mpi/session.hpp>
#include <gradsync/environment.hpp>
#include <gradsync/error.hpp>

#include <numeric>  // for std::iota
#include <string>
#include <utility>  // for std::exchange, std::move
#include <vector>

namespace gradsync::inline v0 {

// A communicator freed with the object. MpiBackend duplicates the one it is given, so this may
// end as soon as the backends over it are made.
class MpiComm {
public:
    MpiComm() = default;
    explicit MpiComm(MPI_Comm comm) : comm_(comm) {}
    MpiComm(MpiComm&& other) noexcept : comm_(std::exchange(other.comm_, MPI_COMM_NULL)) {}
    MpiComm& operator=(MpiComm&& other) noexcept {
        if (this != &other) {
            free();
            comm_ = std::exchange(other.comm_, MPI_COMM_NULL);
        }
        return *this;
    }
    MpiComm(const MpiComm&) = delete;
    MpiComm& operator=(const MpiComm&) = delete;
    ~MpiComm() { free(); }

    [[nodiscard]] MPI_Comm get() const { return comm_; }
    operator MPI_Comm() const { return comm_; }  // NOLINT(google-explicit-constructor): used as one
    [[nodiscard]] int rank() const { return query(MPI_Comm_rank); }
    [[nodiscard]] int size() const { return query(MPI_Comm_size); }

private:
    void free() {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
        comm_ = MPI_COMM_NULL;
    }
    int query(int (*call)(MPI_Comm, int*)) const {
        int out = 0;
        call(comm_, &out);
        return out;
    }

    MPI_Comm comm_ = MPI_COMM_NULL;
};

// The ranks of `parent` with this rank's `colour`, numbered by `key` (ties: by rank in
// `parent`). Collective over `parent`.
inline MpiComm mpi_split(MPI_Comm parent, int colour, int key) {
    if (colour < 0) throw Error("gradsync: mpi_split: a colour must not be negative, got " + std::to_string(colour));
    MPI_Comm out = MPI_COMM_NULL;
    const int rc = MPI_Comm_split(parent, colour, key, &out);
    if (rc != MPI_SUCCESS) throw CollectiveError("gradsync: MPI_Comm_split failed: " + detail::mpi_error_string(rc));
    return MpiComm(out);
}
inline MpiComm mpi_split(MPI_Comm parent, int colour) {
    int rank = 0;
    MPI_Comm_rank(parent, &rank);
    return mpi_split(parent, colour, rank);
}

// The ranks of `parent` on this machine (MPI_COMM_TYPE_SHARED; for processes a torchrun-style
// launcher started and MpiSession joined, those with this processor name).
inline MpiComm mpi_node_comm(MPI_Comm parent = mpi_world()) {
    int rank = 0;
    MPI_Comm_rank(parent, &rank);
    return MpiComm(detail::split_by_node(parent, rank));
}

// Nodes stated rather than found: blocks of `ranks_per_node` consecutive ranks of `parent`, as
// launchers place them by default. For tests that play several machines on one, and for
// machines whose MPI cannot tell.
inline MpiComm mpi_node_comm(MPI_Comm parent, int ranks_per_node) {
    int rank = 0, size = 0;
    MPI_Comm_rank(parent, &rank);
    MPI_Comm_size(parent, &size);
    if (ranks_per_node < 1 || size % ranks_per_node != 0)
        throw Error("gradsync: mpi_node_comm: " + std::to_string(ranks_per_node) + " ranks per node do not divide " +
                    std::to_string(size) + " ranks into whole nodes");
    return mpi_split(parent, rank / ranks_per_node, rank);
}

// Nodes as the launcher placed the ranks: `place` (process_place(): torchrun's LOCAL_RANK and
// LOCAL_WORLD_SIZE, Open MPI's, PaddlePaddle's, MPICH's) gives this rank's place on its node, and
// a node's ranks are consecutive, as launchers number them by default. Checked against every
// rank's place, collectively: a launcher's numbering that is not `parent`'s, or places that are
// not blocks of consecutive ranks (a round-robin placement, a local size the launcher did not
// set), throw on every rank alike.
inline MpiComm mpi_node_comm(MPI_Comm parent, const ProcessPlace& place) {
    int rank = 0, size = 0;
    MPI_Comm_rank(parent, &rank);
    MPI_Comm_size(parent, &size);
    const int numbered_alike = place.rank == rank && place.world_size == size ? 1 : 0;
    const int mine[4] = {numbered_alike, place.rank, place.local_rank, place.local_world_size};
    std::vector<int> all(4 * static_cast<std::size_t>(size));
    MPI_Allgather(mine, 4, MPI_INT, all.data(), 4, MPI_INT, parent);
    const auto at = [&](int r, int k) { return all[4 * static_cast<std::size_t>(r) + static_cast<std::size_t>(k)]; };
    for (int r = 0; r < size; ++r) {
        if (at(r, 0) == 0)
            throw Error("gradsync: mpi_node_comm: rank " + std::to_string(r) + " of this communicator is rank " +
                        std::to_string(at(r, 1)) + " to its launcher: the launcher's places describe another " +
                        "numbering (give the places for the job's own communicator, mpi_world())");
        // Rank r's node: the block from r - local rank, local size long, every rank in it agreeing.
        const int first = r - at(r, 2), count = at(r, 3);
        bool block = first >= 0 && at(r, 2) < count && first + count <= size;
        for (int q = first; block && q < first + count; ++q) block = at(q, 2) == q - first && at(q, 3) == count;
        if (!block)
            throw Error("gradsync: mpi_node_comm: the launcher's places are not blocks of consecutive ranks: rank " +
                        std::to_string(r) + " says it is local rank " + std::to_string(at(r, 2)) + " of " +
                        std::to_string(at(r, 3)) + " on its node, and the ranks around it disagree (a " +
                        "round-robin placement, or a local size the launcher did not set); mpi_node_comm(parent) " +
                        "finds the nodes however the ranks are numbered");
    }
    return mpi_split(parent, rank - place.local_rank, rank);
}

// This rank's peers across machines: the rank of each node with this rank's place in `node`.
// Every node must hold the same number of ranks (checked: throws on every rank otherwise).
inline MpiComm mpi_cross_node_comm(MPI_Comm parent, MPI_Comm node) {
    int local = 0, local_size = 0, rank = 0;
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_rank(parent, &rank);
    int smallest = local_size, largest = local_size;
    MPI_Allreduce(MPI_IN_PLACE, &smallest, 1, MPI_INT, MPI_MIN, parent);
    MPI_Allreduce(MPI_IN_PLACE, &largest, 1, MPI_INT, MPI_MAX, parent);
    if (smallest != largest)
        throw Error("gradsync: mpi_cross_node_comm: the nodes hold between " + std::to_string(smallest) + " and " +
                    std::to_string(largest) + " ranks; a rank's peers across nodes need the same number on each");
    return mpi_split(parent, local, rank);
}

namespace detail {

// Which ranks of the job (mpi_world()) `comm` holds, in its rank order.
inline GroupLabel mpi_group_label(MPI_Comm comm, std::string name) {
    MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    MPI_Comm_group(comm, &mine);
    MPI_Comm_group(mpi_world(), &world);
    int size = 0, world_size = 0;
    MPI_Group_size(mine, &size);
    MPI_Group_size(world, &world_size);
    std::vector<int> ranks(static_cast<std::size_t>(size)), world_ranks(ranks.size());
    std::iota(ranks.begin(), ranks.end(), 0);
    MPI_Group_translate_ranks(mine, size, ranks.data(), world, world_ranks.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    for (const int r : world_ranks)
        if (r == MPI_UNDEFINED) return {std::move(name), {}};  // not of this job's ranks: numbers say nothing
    return group_label(std::move(name), std::move(world_ranks), world_size);
}

}  // namespace detail

}  // namespace gradsync::inline v0
