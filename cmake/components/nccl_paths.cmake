# Where NCCL is, for the build and for gradsync::nccl: beside the CUDA toolkit, or where NCCL_ROOT
# (or the environment's NCCL_HOME or CUDA_HOME) says. Sets GRADSYNC_NCCL_INCLUDE_DIR and
# GRADSYNC_NCCL_LIBRARY (cached), and the CUDAToolkit_* variables.
find_package(CUDAToolkit QUIET)
find_path(GRADSYNC_NCCL_INCLUDE_DIR nccl.h
  HINTS ${NCCL_ROOT} ENV NCCL_HOME ${CUDAToolkit_INCLUDE_DIRS} ENV CUDA_HOME /usr/local/cuda PATH_SUFFIXES include)
find_library(GRADSYNC_NCCL_LIBRARY nccl
  HINTS ${NCCL_ROOT} ENV NCCL_HOME ${CUDAToolkit_LIBRARY_DIR} ENV CUDA_HOME /usr/local/cuda PATH_SUFFIXES lib lib64)
