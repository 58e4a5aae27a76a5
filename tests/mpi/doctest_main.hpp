// The main of the doctest executables that run under mpirun (or joined torchrun-style): every
// rank runs every test case, rank 0 reports in full, the others only their failures, and the
// exit status is nonzero on every rank when a check failed on any.
#pragma once

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <gradsync/backend/mpi.hpp>

int main(int argc, char** argv) {
    gradsync::MpiSession mpi(argc, argv);
    doctest::Context context(argc, argv);
    context.setOption("no-colors", true);  // ctest logs, not terminals
    int rank = 0;
    MPI_Comm_rank(gradsync::mpi_world(), &rank);
    if (rank != 0) context.setOption("minimal", true);
    const int failed = context.run();
    int any = failed != 0 ? 1 : 0, worst = 0;
    MPI_Allreduce(&any, &worst, 1, MPI_INT, MPI_MAX, gradsync::mpi_world());
    return worst;
}
