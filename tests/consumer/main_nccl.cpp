// Through gradsync::nccl (or pkg-config's gradsync-nccl): NcclBackend's header compiles and NCCL
// links; where no GPU is, only NCCL's version is asked for.
#include <gradsync/backend/nccl.hpp>
#include <gradsync/gradsync.hpp>

#include "model.hpp"

#include <cstdio>

static_assert(gradsync::Backend<gradsync::NcclBackend<>>);

int main() {
    int version = 0;
    if (ncclGetVersion(&version) != ncclSuccess) return 1;
    std::printf("consumer nccl ok: NCCL %d\n", version);
}
