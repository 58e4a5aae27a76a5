// gradsync: data-parallel training for C++ trainers. This umbrella header includes every public
// header that needs nothing beyond the C++ standard library, layer by layer (scripts/check_layers.py).
#pragma once

// The vocabulary.
#include <gradsync/buffer.hpp>
#include <gradsync/bytes.hpp>
#include <gradsync/dtype.hpp>
#include <gradsync/environment.hpp>
#include <gradsync/error.hpp>
#include <gradsync/half.hpp>
#include <gradsync/version.hpp>
// Model access.
#include <gradsync/model/buffers.hpp>
#include <gradsync/model/contiguous_parameters.hpp>
#include <gradsync/model/gradient_release.hpp>
#include <gradsync/model/model.hpp>
// Bucket planning.
#include <gradsync/bucket/bucketers.hpp>
#include <gradsync/bucket/plan.hpp>
// Backends.
#include <gradsync/backend/concepts.hpp>
#include <gradsync/backend/handle.hpp>
#include <gradsync/backend/group_label.hpp>
#include <gradsync/backend/local.hpp>
#include <gradsync/backend/two_level.hpp>
// Memory policies.
#include <gradsync/memory/host.hpp>
#include <gradsync/memory/packing.hpp>
#include <gradsync/memory/policy.hpp>
// Mixed precision and learning rates.
#include <gradsync/amp/compression.hpp>
#include <gradsync/amp/loss_scale.hpp>
#include <gradsync/lr.hpp>
// Training metrics.
#include <gradsync/metrics/json_lines.hpp>
#include <gradsync/metrics/step_metrics.hpp>
#include <gradsync/metrics/tensorboard_events.hpp>
// Communication hooks.
#include <gradsync/reduction/comm_hook.hpp>
#include <gradsync/reduction/powersgd.hpp>
// DataParallel.
#include <gradsync/data_parallel.hpp>
#include <gradsync/data_parallel/options.hpp>
#include <gradsync/sharded_data_parallel.hpp>
// Launching ranks.
#include <gradsync/launch/sampler.hpp>
#include <gradsync/launch/spawn.hpp>
