// Diagnosis: where a rank stands, for a peer whose deadline passed, and which bucket was late.
#include <gradsync/backend/local.hpp>
#include <gradsync/data_parallel/diagnosis.hpp>
#include <gradsync/launch/spawn.hpp>

#include <doctest/doctest.h>

#include "support/recording_backend.hpp"

#include <chrono>
#include <string>
#include <vector>

using gradsync::DType;
using gradsync::detail::Readiness;

namespace {

struct Layout {
    std::vector<float> w = std::vector<float>(6), g = std::vector<float>(6);
    std::vector<gradsync::Parameter> params = {{"fc1.weight", w.data(), g.data(), 2, DType::float32},
                                               {"fc1.bias", w.data() + 2, g.data() + 2, 2, DType::float32},
                                               {"fc2.weight", w.data() + 4, g.data() + 4, 2, DType::float32}};
    gradsync::BucketPlan plan;
    Layout() { plan.buckets = {{DType::float32, {2}, 2}, {DType::float32, {1, 0}, 4}}; }
};

}  // namespace

TEST_CASE("diagnosis: where a rank stands, in every phase") {
    Layout l;
    Readiness r;
    r.plan(l.plan, 3);
    CHECK(gradsync::detail::describe_rank(r, 4, l.plan, l.params) ==
          "in step 4, before any grad_ready() or synchronize()");
    (void)r.mark(2, [](std::size_t) {});
    (void)r.mark(0, [](std::size_t) {});
    CHECK(gradsync::detail::describe_rank(r, 4, l.plan, l.params) ==
          "in the backward of step 4, 1 of 2 buckets launched; bucket 1 waits for grad_ready of 'fc1.bias' (1 of 2 "
          "parameters)");
    r.set_phase(Readiness::Phase::synchronizing);
    CHECK(gradsync::detail::describe_rank(r, 4, l.plan, l.params) == "in synchronize() of step 4");
    r.reset();
    Readiness::NoSyncGuard guard(r);
    CHECK(gradsync::detail::describe_rank(r, 5, l.plan, l.params) == "accumulating under no_sync() before step 5");
    CHECK(gradsync::detail::missing_gradients(std::vector<std::size_t>{1}, l.params, r) ==
          "synchronize() found no grad_ready for 1 parameter: 'fc1.bias' (bucket 1). Call grad_ready for every "
          "parameter backward produced a gradient for, or pass gradsync::Options{.find_unused_parameters = true} to "
          "count the others as zero");
}

TEST_CASE("diagnosis: a late bucket is named with its size and parameters, and where peers stand") {
    Layout l;
    std::vector<std::string> said(2);
    gradsync::spawn(2, [&](gradsync::LocalBackend& local) {
        testing_support::RecordingBackend plain(local);  // knows nothing of its peers
        said[static_cast<std::size_t>(local.rank())] =
            gradsync::detail::diagnose_timeout(plain, 3, l.plan, l.params, 1, std::chrono::milliseconds(500));
        const auto id = local.add_status_reporter([] { return std::string("busy"); });
        local.barrier();
        if (local.rank() == 0) {
            const auto peers =
                gradsync::detail::diagnose_timeout(local, 3, l.plan, l.params, 0, std::chrono::milliseconds(500));
            CHECK(peers.find("; rank 0 (this rank): busy; rank 1: busy") != std::string::npos);
        }
        local.barrier();
        local.remove_status_reporter(id);
    });
    CHECK(said[0] ==
          "gradsync: rank 0, step 3: bucket 1 of 2 (16 B, 2 parameters: 'fc1.bias', 'fc1.weight') was not reduced "
          "within 500 ms");
    CHECK(said[1].find("gradsync: rank 1, step 3: bucket 1 of 2") == 0);
}
