# gradsync::mpi: gradsync with MpiBackend (gradsync/backend/mpi.hpp) and the MPI it calls.
find_package(MPI QUIET COMPONENTS CXX)
_gradsync_component(mpi MPI_CXX_FOUND MPI::MPI_CXX ""
  "gradsync::mpi needs MPI for C++ (Debian: apt-get install libopenmpi-dev).")
