// Replicas that drift apart are caught: every rank's parameters (and the buffers kept equal) are
// hashed and compared every Options::check_replicas_every steps and on demand, and a trainer that
// passes its step number, or reports gradients during backward, has a skipped iteration caught at
// that very step.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "support/toy_model.hpp"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

using gradsync::DataParallel;
using gradsync::LocalBackend;
using gradsync::Options;
using gradsync::StepNumber;
using testing_support::Toy;

namespace {

// What each rank threw (empty: nothing), and in which step of its loop.
struct Outcome {
    std::string what;
    int step = -1;
};

// body(backend, step) runs a rank's whole loop, keeping `step` current.
template <class Body>
std::vector<Outcome> run(int world, Body body) {
    std::vector<Outcome> out(static_cast<std::size_t>(world));
    gradsync::spawn(world, [&](LocalBackend& b) {
        int s = -1;
        try {
            body(b, s);
        } catch (const std::exception& e) {
            out[static_cast<std::size_t>(b.rank())] = {e.what(), s};
        }
    });
    return out;
}

void sgd(Toy& m) {
    for (auto& t : m.tensors)
        for (std::size_t i = 0; i < t.w.size(); ++i) t.w[i] -= 0.5f * t.g[i];
}

}  // namespace

TEST_CASE("content hash: equal bytes hash alike, and any one flipped bit changes the hash, at every length") {
    for (std::size_t n : {0u, 1u, 7u, 8u, 31u, 32u, 33u, 63u, 64u, 100u}) {
        std::vector<unsigned char> a(n), b(n);
        for (std::size_t i = 0; i < n; ++i) a[i] = b[i] = static_cast<unsigned char>(i * 37 + 11);
        const auto h = gradsync::detail::content_hash(a.data(), n);
        CHECK(gradsync::detail::content_hash(b.data(), n) == h);
        for (std::size_t i = 0; i < n; ++i)
            for (int bit = 0; bit < 8; ++bit) {
                b[i] ^= static_cast<unsigned char>(1u << bit);
                CAPTURE(n);
                CAPTURE(i);
                CAPTURE(bit);
                CHECK(gradsync::detail::content_hash(b.data(), n) != h);
                b[i] ^= static_cast<unsigned char>(1u << bit);
            }
    }
    // Length is part of the hash: trailing zeros are not invisible.
    const std::vector<unsigned char> zeros(16, 0);
    CHECK(gradsync::detail::content_hash(zeros.data(), 8) != gradsync::detail::content_hash(zeros.data(), 16));
}

TEST_CASE("replica check: a parameter changed on one rank is named, with the rank, at the next check") {
    const auto got = run(4, [](LocalBackend& b, int& s) {
        Toy m({40, 1000, 3}, 0.5f);
        DataParallel dp(m, b, Options{.check_replicas_every = 3});
        for (s = 0; s < 6; ++s) {
            m.fill_grads(b.rank());
            if (s == 1 && b.rank() == 2) m.tensors[1].w[999] += 1e-6f;  // a tiny drift on one rank
            dp.synchronize();
            sgd(m);
        }
    });
    for (const auto& o : got) {
        CAPTURE(o.what);
        CHECK(o.step == 2);  // the check after the third step
        CHECK(o.what == got[0].what);
        CHECK(o.what.find("gradsync: step 3: the ranks' replicas differ: parameter 't1' on rank 2 is not rank 0's "
                          "(1 of 3 tensors differ)") != std::string::npos);
    }
}

TEST_CASE("replica check: unchanged replicas pass every check, and buffers broadcast once may differ") {
    const auto got = run(3, [](LocalBackend& b, int& s) {
        Toy m({64, 5}, 0.25f);
        m.running_mean.assign(4, 0.0f);
        DataParallel dp(m, b, gradsync::BroadcastBuffersOnce{}, Options{.check_replicas_every = 1});
        for (s = 0; s < 8; ++s) {
            m.fill_grads(b.rank());
            m.running_mean[0] += static_cast<float>(b.rank());  // local statistics, by design
            dp.synchronize();
            sgd(m);
            dp.check_replicas();
        }
    });
    for (const auto& o : got) CHECK(o.what.empty());
}

TEST_CASE("replica check: a buffer averaged every step is compared too, and on demand between steps") {
    const auto got = run(2, [](LocalBackend& b, int&) {
        Toy m({16}, 1.0f);
        m.running_mean.assign(4, 1.0f);
        DataParallel dp(m, b, gradsync::AverageBuffers{}, Options{.check_replicas_every = 0});
        m.fill_grads(b.rank());
        dp.synchronize();
        if (b.rank() == 1) m.running_mean[3] = 2.0f;
        dp.check_replicas();
    });
    for (const auto& o : got)
        CHECK(o.what.find("after step 1: the ranks' replicas differ: buffer 'bn.running_mean' on rank 1") !=
              std::string::npos);
}

TEST_CASE("replica check: by default every 500 steps on host memory, off on device memory, and ranks agree on it") {
    CHECK(Options{}.replica_check_interval(false) == Options::replica_check_default);
    CHECK(Options::replica_check_default == 500);
    CHECK(Options{}.replica_check_interval(true) == 0);
    CHECK(Options{.check_replicas_every = 7}.replica_check_interval(true) == 7);
    const auto got = run(2, [](LocalBackend& b, int&) {
        Toy m({16}, 1.0f);
        DataParallel dp(m, b, Options{.check_replicas_every = b.rank() == 0 ? 10u : 20u});
    });
    for (const auto& o : got)
        CHECK(o.what.find("Options::check_replicas_every is '10' on rank 0 but '20' on rank 1") != std::string::npos);
    // The default check runs at step 500: a drift at step 250 is caught there.
    const auto late = run(2, [](LocalBackend& b, int& s) {
        Toy m({16}, 1.0f);
        DataParallel dp(m, b);
        for (s = 0; s < 501; ++s) {
            m.fill_grads(b.rank());
            if (s == 250 && b.rank() == 1) m.tensors[0].w[0] = 3.0f;
            dp.synchronize();
        }
    });
    for (const auto& o : late) {
        CHECK(o.step == 499);
        CHECK(o.what.find("step 500: the ranks' replicas differ: parameter 't0' on rank 1") != std::string::npos);
    }
}

TEST_CASE("step number: a rank that skipped an iteration is caught at that very step, before any update") {
    // Rank 1 skips iteration 2 (a bad batch, say) and goes on with iteration 3: its synchronize()
    // pairs with rank 0's iteration 2. Without step numbers the gradients of different
    // iterations would be averaged; with them, both ranks stop at that synchronize().
    std::vector<std::vector<float>> weights(2);
    const auto got = run(2, [&](LocalBackend& b, int& s) {
        Toy m({32}, 1.0f);
        DataParallel dp(m, b, Options{.check_replicas_every = 0});
        for (s = 0; s < 5; ++s) {
            if (s == 2 && b.rank() == 1) continue;
            m.fill_grads(b.rank());
            dp.step([&] { sgd(m); }, StepNumber{static_cast<std::uint64_t>(s)});
            weights[static_cast<std::size_t>(b.rank())] = m.tensors[0].w;
        }
    });
    CHECK(got[0].step == 2);
    CHECK(got[1].step == 3);
    for (const auto& o : got)
        CHECK(o.what.find("step 3: the ranks are at different steps of the trainer: rank 0 passed step number 2 "
                          "and rank 1 3") != std::string::npos);
    CHECK(weights[0] == weights[1]);  // the mismatched step updated nothing
}

TEST_CASE("overlapped, a rank that skipped a step() is caught at its next backward without a step number") {
    // grad_ready reports each gradient of a step once: rank 1 skips step() at iteration 2, so its
    // backward of iteration 3 reports its parameters a second time in the same step. That is
    // refused there and the group is aborted: rank 0 fails in its step 2 or 3 (the buckets rank 1
    // launched in iteration 2 may have completed rank 0's step 2, with gradients of the same
    // iteration), or as it ends step 1, naming rank 1. No step averages gradients of different
    // iterations.
    std::vector<std::uint64_t> done(2);
    const auto got = run(2, [&](LocalBackend& b, int& s) {
        Toy m({32, 16}, 1.0f);
        DataParallel dp(m, b, Options{.check_replicas_every = 0});
        for (s = 0; s < 5; ++s) {
            // Rank 1's backward of iteration 3 leaves its gradients alone: the collectives launched
            // in iteration 2 may still read them (a race of the trainer's own making, which
            // ThreadSanitizer would report).
            if (!(s == 3 && b.rank() == 1)) m.fill_grads(b.rank());
            for (std::size_t p = 2; p-- > 0;) dp.grad_ready(p);  // backward
            if (s == 2 && b.rank() == 1) continue;
            dp.step([&] { sgd(m); });
            done[static_cast<std::size_t>(b.rank())] = dp.steps();
        }
    });
    INFO("rank 0 at " << got[0].step << ": " << got[0].what);
    CHECK(got[0].step >= 1);  // the abort may reach it as it ends the step before
    CHECK(got[0].step <= 3);
    CHECK(got[1].step == 3);
    CHECK(got[1].what.find("rank 1, step 3: grad_ready for parameter 't1' was called twice in one step") !=
          std::string::npos);
    CHECK(got[0].what.find("rank 1") != std::string::npos);
    CHECK(done[0] <= 3);
    CHECK(done[1] == 2);
}

TEST_CASE("an error raised on every rank alike leaves the group usable: realign the replicas and train on") {
    static_assert(std::is_base_of_v<gradsync::RaisedOnEveryRank, gradsync::ReplicaMismatch>);
    static_assert(std::is_base_of_v<gradsync::RaisedOnEveryRank, gradsync::StepMismatch>);
    static_assert(std::is_base_of_v<gradsync::RaisedOnEveryRank, gradsync::LayoutMismatch>);
    static_assert(!std::is_base_of_v<gradsync::RaisedOnEveryRank, gradsync::TimeoutError>);
    std::vector<std::vector<float>> weights(3);
    const auto got = run(3, [&](LocalBackend& b, int& s) {
        Toy m({64, 8}, 0.5f);
        DataParallel dp(m, b, Options{.check_replicas_every = 2});
        int caught = 0;
        for (s = 0; s < 6; ++s) {
            m.fill_grads(b.rank());
            if (s == 0 && b.rank() == 1) m.tensors[0].w[3] += 1.0f;
            try {
                dp.synchronize();
            } catch (const gradsync::RaisedOnEveryRank&) {  // the replica check of step 2
                ++caught;
                dp.broadcast_parameters();  // rank 0's values everywhere; the group was not aborted
                continue;
            }
            sgd(m);
        }
        dp.check_replicas();
        if (caught != 1) throw std::runtime_error("caught " + std::to_string(caught) + " mismatches");
        weights[static_cast<std::size_t>(b.rank())] = m.tensors[0].w;
    });
    for (const auto& o : got) CHECK(o.what.empty());
    CHECK(weights[1] == weights[0]);
    CHECK(weights[2] == weights[0]);
}
