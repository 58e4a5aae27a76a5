// GRADSYNC_HOST_DEVICE: marks a function that plain C++ and CUDA device code both call (a
// bucket's walk, PowerSGD's draws), so that the host tests cover what the kernels run.
#pragma once

#if defined(__CUDACC__)
#define GRADSYNC_HOST_DEVICE __host__ __device__
#else
#define GRADSYNC_HOST_DEVICE
#endif
