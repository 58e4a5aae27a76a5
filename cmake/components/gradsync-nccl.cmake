# gradsync::nccl: gradsync with NcclBackend (gradsync/backend/nccl.hpp) and CudaMemory
# (gradsync/memory/cuda.cuh): the CUDA runtime and NCCL (found as nccl_paths.cmake says).
include(${CMAKE_CURRENT_LIST_DIR}/nccl_paths.cmake)
set(_gradsync_nccl_found FALSE)
if(CUDAToolkit_FOUND AND GRADSYNC_NCCL_INCLUDE_DIR AND GRADSYNC_NCCL_LIBRARY)
  set(_gradsync_nccl_found TRUE)
endif()
_gradsync_component(nccl _gradsync_nccl_found "CUDA::cudart;${GRADSYNC_NCCL_LIBRARY}" "${GRADSYNC_NCCL_INCLUDE_DIR}"
  "gradsync::nccl needs the CUDA toolkit (found: ${CUDAToolkit_FOUND}) and NCCL (nccl.h: ${GRADSYNC_NCCL_INCLUDE_DIR}, libnccl: ${GRADSYNC_NCCL_LIBRARY}); set NCCL_ROOT where NCCL is.")
unset(_gradsync_nccl_found)
