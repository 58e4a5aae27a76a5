// MPI's C interface, and small helpers around it: error strings, the thread level, and errors
// returned as codes for a while. Needs <mpi.h> and an MPI library (CMake: MPI::MPI_CXX).
#pragma once

#include <gradsync/version.hpp>

// Only MPI's C interface is used; skip the deprecated C++ bindings some MPIs still ship.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstddef>
#include <string>

namespace gradsync::inline v0::detail {

inline std::string mpi_error_string(int code) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
    return std::string(text, static_cast<std::size_t>(length));
}

inline const char* thread_level_name(int level) {
    switch (level) {
        case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
        case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
        case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
        case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
        default: return "an unknown thread level";
    }
}

inline int mpi_thread_level() {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    return level;
}

// Makes a communicator's errors come back as return codes for the guard's lifetime.
class ErrorsReturned {
public:
    explicit ErrorsReturned(MPI_Comm comm) : comm_(comm) {
        MPI_Comm_get_errhandler(comm_, &previous_);
        MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    }
    ErrorsReturned(const ErrorsReturned&) = delete;
    ErrorsReturned& operator=(const ErrorsReturned&) = delete;
    ~ErrorsReturned() {
        MPI_Comm_set_errhandler(comm_, previous_);
        MPI_Errhandler_free(&previous_);
    }

private:
    MPI_Comm comm_;
    MPI_Errhandler previous_ = MPI_ERRHANDLER_NULL;
};

}  // namespace gradsync::inline v0::detail
