// NCCL's unique id through MPI, under mpirun (ctest runs it with 3 processes). Needs NCCL's
// library, not a GPU: creating the id opens the bootstrap socket only.
#include "mpi/doctest_main.hpp"

#include <gradsync/backend/nccl_mpi.hpp>

#include <cstdlib>  // for setenv, unsetenv
#include <cstring>
#include <string>
#include <vector>

namespace {

// Every rank's id, gathered on every rank.
std::vector<ncclUniqueId> gather(const ncclUniqueId& mine) {
    int n = 1;
    MPI_Comm_size(gradsync::mpi_world(), &n);
    std::vector<ncclUniqueId> all(static_cast<std::size_t>(n));
    MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, gradsync::mpi_world());
    return all;
}

bool same(const ncclUniqueId& a, const ncclUniqueId& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST_CASE("nccl_unique_id: every rank gets the root's id, and each call makes a new one") {
    const ncclUniqueId first = gradsync::nccl_unique_id();
    const ncclUniqueId second = gradsync::nccl_unique_id();
    for (const auto& id : gather(first)) CHECK(same(id, first));
    for (const auto& id : gather(second)) CHECK(same(id, second));
    CHECK_FALSE(same(first, second));
    CHECK_FALSE(same(first, ncclUniqueId{}));  // not left zero
}

TEST_CASE("nccl_unique_id: another root") {
    int n = 1;
    MPI_Comm_size(gradsync::mpi_world(), &n);
    const ncclUniqueId id = gradsync::nccl_unique_id(gradsync::mpi_world(), n - 1);
    for (const auto& other : gather(id)) CHECK(same(other, id));
}

TEST_CASE("nccl_unique_id: a root that cannot make one fails every rank with NCCL's reason") {
    int rank = 0;
    MPI_Comm_rank(gradsync::mpi_world(), &rank);
    if (rank == 0) setenv("NCCL_COMM_ID", "not an address", 1);  // NCCL reads it in ncclGetUniqueId
    std::string what;
    try {
        (void)gradsync::nccl_unique_id();
    } catch (const gradsync::CollectiveError& e) {
        what = e.what();
    }
    if (rank == 0) unsetenv("NCCL_COMM_ID");
    CHECK(what.find("gradsync: ncclGetUniqueId failed on rank 0: invalid argument") != std::string::npos);
    CHECK(what.find("Invalid NCCL_COMM_ID") != std::string::npos);
    // Still usable afterwards.
    const ncclUniqueId id = gradsync::nccl_unique_id();
    for (const auto& other : gather(id)) CHECK(same(other, id));
}
