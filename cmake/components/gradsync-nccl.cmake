# gradsync::nccl: gradsync with NcclBackend (gradsync/backend/nccl.hpp) and CudaMemory
# (gradsync/memory/cuda.cuh): the CUDA runtime and NCCL. NCCL is looked for beside the CUDA
# toolkit, or where NCCL_ROOT (or the environment's NCCL_HOME) says.
find_package(CUDAToolkit QUIET)
find_path(GRADSYNC_NCCL_INCLUDE_DIR nccl.h
  HINTS ${NCCL_ROOT} ENV NCCL_HOME ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
find_library(GRADSYNC_NCCL_LIBRARY nccl
  HINTS ${NCCL_ROOT} ENV NCCL_HOME ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
set(_gradsync_nccl_found FALSE)
if(CUDAToolkit_FOUND AND GRADSYNC_NCCL_INCLUDE_DIR AND GRADSYNC_NCCL_LIBRARY)
  set(_gradsync_nccl_found TRUE)
endif()
_gradsync_component(nccl _gradsync_nccl_found "CUDA::cudart;${GRADSYNC_NCCL_LIBRARY}" "${GRADSYNC_NCCL_INCLUDE_DIR}"
  "gradsync::nccl needs the CUDA toolkit (found: ${CUDAToolkit_FOUND}) and NCCL (nccl.h: ${GRADSYNC_NCCL_INCLUDE_DIR}, libnccl: ${GRADSYNC_NCCL_LIBRARY}); set NCCL_ROOT where NCCL is.")
unset(_gradsync_nccl_found)
