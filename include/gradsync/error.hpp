// The exceptions gradsync throws. Every message names the rank, the operation and, where there
// is one, the parameter, and says what to do about it.
#pragma once

#include <gradsync/version.hpp>

#include <stdexcept>  // for std::runtime_error
#include <string>

namespace gradsync::inline v0 {

// Base of every gradsync exception.
class Error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Marks an error that every rank raises alike, with the same message, after their collectives
// completed: no rank is left waiting, so the group needs no abort and may go on. Catch it as its
// own type, or as `const gradsync::RaisedOnEveryRank&` to handle every such error at once.
class RaisedOnEveryRank {};

// The model handed to gradsync is unusable: null gradient, unsupported dtype, aliased buffers.
class InvalidModel : public Error {
public:
    using Error::Error;
};

// The DataParallel's configuration is invalid (a zero timeout, a loss scaler that cannot work), or
// differs across ranks in a setting that changes the sums. Thrown on every rank alike.
class ConfigurationError : public Error {
public:
    using Error::Error;
};

// Ranks disagree on the model's parameter layout. Thrown on every rank with the same message.
class LayoutMismatch : public Error, public RaisedOnEveryRank {
public:
    using Error::Error;
};

// A collective failed: a peer failed or left, ranks called different collectives, bad arguments.
class CollectiveError : public Error {
public:
    using Error::Error;
};

// The ranks' replicas differ: parameters (or buffers kept equal, or checkpointed state) that
// every rank should hold bit for bit do not match. Thrown on every rank with the same message.
class ReplicaMismatch : public Error, public RaisedOnEveryRank {
public:
    using Error::Error;
};

// The ranks' collective histories differ (found by comparing them, once per step where asked):
// a rank launched other collectives, or stepped its DataParallel objects in another order. Thrown
// on every rank with the same message, before any update.
class HistoryMismatch : public CollectiveError, public RaisedOnEveryRank {
public:
    using CollectiveError::CollectiveError;
};

// The ranks are at different steps of the trainer (by the step numbers it passed): a rank skipped
// or repeated an iteration. Thrown on every rank with the same message, before any update.
class StepMismatch : public CollectiveError, public RaisedOnEveryRank {
public:
    using CollectiveError::CollectiveError;
};

// A collective did not complete before its deadline.
class TimeoutError : public CollectiveError {
public:
    using CollectiveError::CollectiveError;
};

namespace detail {

// How every message about one rank begins: "gradsync: rank 3".
inline std::string rank_prefix(int rank) { return "gradsync: rank " + std::to_string(rank); }

// ...and with its group and where it runs: "gradsync: rank 3 of 4 (NCCL, GPU 3)".
inline std::string rank_prefix(int rank, int size, const std::string& where = {}) {
    return rank_prefix(rank) + " of " + std::to_string(size) + (where.empty() ? "" : " (" + where + ")");
}

}  // namespace detail

}  // namespace gradsync::inline v0
