// Runs a doctest context on every MPI rank (started by mpirun or joined torchrun-style): rank 0
// reports in full, the others only their failures, and the result is nonzero on every rank when a
// check failed on any.
#pragma once

#include <doctest/doctest.h>

#include <gradsync/backend/mpi.hpp>

namespace gradsync_test {

inline int run_on_every_rank(doctest::Context& context, int argc, char** argv) {
    gradsync::MpiSession mpi(argc, argv);
    int rank = 0;
    MPI_Comm_rank(gradsync::mpi_world(), &rank);
    if (rank != 0) context.setOption("minimal", true);
    const int failed = context.run();
    int any = failed != 0 ? 1 : 0, worst = 0;
    MPI_Allreduce(&any, &worst, 1, MPI_INT, MPI_MAX, gradsync::mpi_world());
    return worst;
}

}  // namespace gradsync_test
