// The main of the doctest executables that run under mpirun (or joined torchrun-style).
#pragma once

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "mpi/run_on_every_rank.hpp"

int main(int argc, char** argv) {
    doctest::Context context(argc, argv);
    context.setOption("no-colors", true);  // ctest logs, not terminals
    return gradsync_test::run_on_every_rank(context, argc, argv);
}
