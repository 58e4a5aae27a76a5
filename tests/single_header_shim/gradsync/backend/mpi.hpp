// Routes <gradsync/...> to the single header, to prove it stands alone.
#pragma once
#include <gradsync_mpi.hpp>
