// ShardedDataParallel's safety checks, as DataParallel has them: a rank that skipped an iteration
// is caught at that very step by the trainer's step number, before any update; every collective
// names its step and bucket, so a peer that waits too long says which one, and step() names a
// launched bucket that is late by ShardedOptions::timeout; a misuse of grad_ready
// on one rank fails its peers at once, naming the rank and the step.
#include <gradsync/backend/local.hpp>
#include <gradsync/launch/spawn.hpp>
#include <gradsync/sharded_data_parallel.hpp>

#include <doctest/doctest.h>

#include "support/toy_model.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

// Plain SGD over this rank's pieces.
void shard_sgd(std::span<const gradsync::ShardPiece<float>> pieces) {
    for (const auto& piece : pieces)
        for (std::size_t i = 0; i < piece.params.size(); ++i) piece.params[i] -= 0.1f * piece.grads[i];
}

gradsync::SizeCappedBuckets small_buckets() { return gradsync::SizeCappedBuckets{.cap = gradsync::Bytes{1024}}; }

}  // namespace

TEST_CASE("sharded: a rank that skipped an iteration is caught at that very step by its number, before any update") {
    // Rank 1 skips iteration 2 and goes on with iteration 3: its step() pairs with rank 0's
    // iteration 2. With step numbers both ranks stop there, with the same StepMismatch.
    std::vector<std::string> what(2);
    std::vector<int> stopped_at(2, -1);
    std::vector<std::vector<float>> weights(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        const auto r = static_cast<std::size_t>(backend.rank());
        testing_support::Toy model({300, 200}, 1.0f);
        gradsync::ShardedDataParallel sharded(model, backend, small_buckets());
        for (int s = 0; s < 5; ++s) {
            if (s == 2 && r == 1) continue;
            model.fill_grads(backend.rank());
            try {
                (void)sharded.step(shard_sgd, gradsync::StepNumber{static_cast<std::uint64_t>(s)});
            } catch (const gradsync::StepMismatch& e) {
                what[r] = e.what();
                stopped_at[r] = s;
                break;
            }
            weights[r] = model.tensors[0].w;
        }
    });
    CHECK(stopped_at == std::vector<int>{2, 3});
    for (const auto& w : what) {
        CAPTURE(w);
        CHECK(w.find("step 3: the ranks are at different steps of the trainer: rank 0 passed step number 2 and rank "
                     "1 3") != std::string::npos);
    }
    CHECK(weights[0] == weights[1]);  // the mismatched step updated nothing
}

TEST_CASE("sharded: a peer that waits past the deadline names the step and the bucket of its collective") {
    // Rank 1 spends longer than the group's deadline in its optimizer of step 2: rank 0, waiting
    // in the all_gather of the step's first bucket, times out and says which collective it was.
    gradsync::LocalGroupOptions group;
    group.timeout = 300ms;
    std::string what;
    gradsync::spawn(
        2,
        [&](gradsync::LocalBackend& backend) {
            testing_support::Toy model({300, 200}, 1.0f);
            gradsync::ShardedDataParallel sharded(model, backend, small_buckets(),
                                                  gradsync::ShardedOptions{.timeout = 60s});
            try {
                for (int s = 0; s < 2; ++s) {
                    model.fill_grads(backend.rank());
                    (void)sharded.step([&](std::span<const gradsync::ShardPiece<float>> pieces) {
                        if (s == 1 && backend.rank() == 1) std::this_thread::sleep_for(1500ms);
                        shard_sgd(pieces);
                    });
                }
            } catch (const gradsync::TimeoutError& e) {
                if (backend.rank() == 0) what = e.what();
            } catch (const gradsync::CollectiveError&) {  // rank 1: the group failed meanwhile
            }
        },
        group);
    CAPTURE(what);
    CHECK(what.find("all_gather #") != std::string::npos);
    CHECK(what.find("(step 2, bucket 0): timed out after 300 ms waiting for rank 1") != std::string::npos);
}

TEST_CASE("sharded: a bucket launched in backward that no peer joins is named at step()'s deadline") {
    // Rank 0 launches both buckets during backward and waits in step() by ShardedOptions::timeout;
    // rank 1 is late by far more. Rank 0 names the first bucket, its size and parameters; its
    // failure aborts the group, so rank 1 fails at once when it comes, naming rank 0.
    gradsync::LocalGroupOptions group;
    group.timeout = 60s;  // the backend's own deadline is not the one that fires
    std::vector<std::string> what(2);
    const auto start = std::chrono::steady_clock::now();
    gradsync::spawn(
        2,
        [&](gradsync::LocalBackend& backend) {
            const auto r = static_cast<std::size_t>(backend.rank());
            testing_support::Toy model({300, 200}, 1.0f);
            gradsync::ShardedDataParallel sharded(model, backend, small_buckets(),
                                                  gradsync::ShardedOptions{.timeout = 300ms});
            model.fill_grads(backend.rank());
            try {
                if (r == 1) std::this_thread::sleep_for(1500ms);
                sharded.grad_ready(std::size_t{0});
                sharded.grad_ready(std::size_t{1});
                (void)sharded.step(shard_sgd);
            } catch (const gradsync::TimeoutError& e) {
                what[r] = std::string("timeout: ") + e.what();
            } catch (const gradsync::CollectiveError& e) {
                what[r] = std::string("collective: ") + e.what();
            }
        },
        group);
    CAPTURE(what[0]);
    CAPTURE(what[1]);
    CHECK(what[0].find("timeout: gradsync: rank 0, step 1: bucket 0 of 2 (") == 0);
    CHECK(what[0].find("parameters: 't") != std::string::npos);
    CHECK(what[0].find("was not reduced within 300 ms") != std::string::npos);
    CHECK(what[1].find("collective: ") == 0);
    CHECK(what[1].find("rank 0") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start < 30s);  // not the group's 60 s deadline
}

TEST_CASE("sharded: grad_ready twice on one rank fails its peers at once, naming the rank and the step") {
    std::string peer, own;
    const auto start = std::chrono::steady_clock::now();
    gradsync::spawn(2, [&](gradsync::LocalBackend& backend) {
        testing_support::Toy model({300, 200}, 1.0f);
        gradsync::ShardedDataParallel sharded(model, backend, small_buckets());
        model.fill_grads(backend.rank());
        try {
            sharded.grad_ready(std::size_t{1});
            if (backend.rank() == 1) sharded.grad_ready(std::size_t{1});
            sharded.grad_ready(std::size_t{0});
            (void)sharded.step(shard_sgd);
        } catch (const gradsync::ReadinessError& e) {
            own = e.what();
        } catch (const gradsync::CollectiveError& e) {
            peer = e.what();
        }
    });
    CHECK(own == "gradsync: rank 1, step 1: grad_ready for parameter 't1' was called twice in one step");
    CAPTURE(peer);
    CHECK(peer.find("gradsync: rank 1, step 1: grad_ready for parameter 't1' was called twice in one step") !=
          std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start < 60s);  // not the 600 s deadline
}
