// Through gradsync::mpi (or pkg-config's gradsync-mpi): two processes under mpirun average a
// gradient with MpiBackend.
#include <gradsync/backend/mpi.hpp>
#include <gradsync/gradsync.hpp>

#include "model.hpp"

#include <cstdio>

int main(int argc, char** argv) {
    gradsync::MpiSession mpi(argc, argv);
    gradsync::MpiBackend backend;
    Model model;
    gradsync::DataParallel dp(model, backend);
    model.g.assign(3, float(backend.rank() + 1));
    dp.synchronize();
    if (backend.rank() == 0) std::printf("consumer mpi ok: average %.1f over %d ranks\n", model.g[0], backend.size());
}
