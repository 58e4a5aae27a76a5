// ShardedOptions: the run-time settings of a ShardedDataParallel, passed like a policy (in any
// position after the backend), e.g.
// ShardedDataParallel sdp(model, backend, gradsync::ShardedOptions{.release_gradients = true}).
#pragma once

#include <gradsync/detail/policy.hpp>

#include <chrono>

namespace gradsync::inline v0 {

struct ShardedOptions {
    using policy_category = policy_category::options;

    // Above 0: gradients whose global L2 norm exceeds it are scaled down to it before the optimizer.
    double clip_norm = 0;
    // Stage 2: once a bucket is reduce-scattered (during backward with grad_ready), this rank's
    // share of its averaged gradients is copied into memory of the wrapper's (state_elements()
    // floats) and the model is told to release the bucket's gradients
    // (gradsync::release_gradients), so that a model which makes its gradients in backward holds
    // about a bucket or two of them at a time instead of all. Needs such a model and a backend
    // that reduces where the gradients lie (LocalBackend, MpiBackend).
    bool release_gradients = false;
    // Gradients whose storage moves between steps (made anew in backward) are followed: the model
    // is listed again before each bucket is reduced. Always on with release_gradients.
    bool storage_may_move = true;
    // Once per step, after the reduce-scatters and before the optimizer, with a backend that
    // cannot compare the ranks' collectives as they are issued (MpiBackend), one small allreduce
    // compares the ranks' collective histories, so that ranks whose collectives diverged fail
    // instead of updating from mixed gradients. false turns it off. (A step number passed to
    // step() is checked there whatever this says.)
    bool check_histories = true;
    // step() returns with the updated parameters' all-gathers in flight, launched in the order the
    // forward reads the buckets, and the next forward waits for each parameter's bucket only when
    // it reaches it: call param_ready(index or name) before the forward reads a parameter (or
    // wait_for_parameters() for all), so that the gathers of later buckets overlap the forward's
    // earlier layers. A parameter read without waiting is found at its gradient or the next step()
    // and fails the group. Host backends (LocalBackend, MpiBackend).
    bool gather_behind_forward = false;
    // How long step() waits for a bucket's reduce-scatter launched during backward (a TimeoutError
    // then names the bucket and the ranks behind, where the backend can tell), and how long a
    // failed step or a destroyed ShardedDataParallel waits for the collectives it abandons, after
    // aborting the group (where the backend can be aborted they end at once).
    std::chrono::milliseconds timeout = std::chrono::seconds(600);
};

}  // namespace gradsync::inline v0
