// The MPI family: MpiSession and mpi_world() (backend/mpi/session.hpp), communicators of groups
// of ranks (backend/mpi/groups.hpp), the torchrun-style join (backend/mpi/join.hpp) and
// MpiBackend (backend/mpi/backend.hpp), and a SharedMemoryBackend over a node's processes
// (backend/mpi/shared_memory_group.hpp). Not included by
// <gradsync/gradsync.hpp>: include this header where <mpi.h> is available and link MPI (CMake:
// MPI::MPI_CXX).
#pragma once

#include <gradsync/backend/mpi/backend.hpp>
#include <gradsync/backend/mpi/groups.hpp>
#include <gradsync/backend/mpi/join.hpp>
#include <gradsync/backend/mpi/session.hpp>
#include <gradsync/backend/mpi/shared_memory_group.hpp>
