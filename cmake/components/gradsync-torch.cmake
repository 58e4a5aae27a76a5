# gradsync::torch: gradsync with its libtorch adapter (gradsync/torch.hpp) and libtorch, found
# through its own TorchConfig.cmake (Debian's libtorch-dev, or Torch_DIR for an unpacked one).
find_package(Torch QUIET)
_gradsync_component(torch Torch_FOUND "${TORCH_LIBRARIES}" ""
  "gradsync::torch needs libtorch (Debian: apt-get install libtorch-dev, or set Torch_DIR).")
