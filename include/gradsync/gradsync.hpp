// gradsync: data-parallel training for C++ trainers. This umbrella header includes every public
// header that needs nothing beyond the C++ standard library.
#pragma once

#include <gradsync/amp.hpp>
#include <gradsync/backend.hpp>
#include <gradsync/backend/local.hpp>
#include <gradsync/bucket.hpp>
#include <gradsync/buffers.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/compression.hpp>
#include <gradsync/contiguous_parameters.hpp>
#include <gradsync/data_parallel.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/environment.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>
#include <gradsync/lr.hpp>
#include <gradsync/memory.hpp>
#include <gradsync/model.hpp>
#include <gradsync/options.hpp>
#include <gradsync/sampler.hpp>
#include <gradsync/spawn.hpp>
#include <gradsync/version.hpp>
