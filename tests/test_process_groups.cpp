// Backends over some of the job's ranks: a DataParallel over a group is one data-parallel
// dimension of a larger job. 4 ranks as 2 groups of 2, each group with its own "model shard",
// each group == one process trained on its group's global batch; collectives of the groups and
// of the whole job interleave; every message names the group and its job ranks.
#include <gradsync/gradsync.hpp>

#include <doctest/doctest.h>

#include "mlp.hpp"
#include "support/shard_training.hpp"

#include <cmath>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

// Named, and around the test cases too, so that its names hide those of test files a unity build
// puts beside it.
namespace process_groups {

using gradsync_test::data_seed;
using gradsync_test::model_seed;
using gradsync_test::relative_difference;
using gradsync_test::Weights;
using gradsync_test::weights_of;

constexpr int steps = 12;
constexpr int micro_batch = 8;
constexpr int shards = 2;    // the model dimension: shard = job rank % 2
constexpr int replicas = 2;  // the data-parallel dimension: ranks {s, s + 2} train shard s

std::string shard_group_name(int colour) { return "replicas of shard " + std::to_string(colour); }

TEST_CASE("process groups: 4 ranks as 2 data-parallel groups of 2, each group == one process on its global batch") {
    const std::vector<int> colours = {0, 1, 0, 1};  // job rank r holds shard r % 2
    auto groups = gradsync::LocalBackend::split(colours, {}, shard_group_name);
    std::vector<Weights> ended(4);
    std::vector<std::vector<float>> job_sums(4);
    gradsync::spawn(4, [&](gradsync::LocalBackend& job) {
        const int me = job.rank();
        const int shard = me % shards;
        gradsync::LocalBackend& group = groups[static_cast<std::size_t>(me)];
        REQUIRE(group.size() == replicas);
        CHECK(group.rank() == me / shards);  // numbered in job rank order within the group
        // A different start on each replica: the group's rank 0 broadcasts its own.
        mlp::Mlp model(model_seed(shard) + static_cast<std::uint64_t>(group.rank()) * 1000);
        if (group.rank() == 0) CHECK(weights_of(model) == weights_of(mlp::Mlp(model_seed(shard))));
        gradsync::DataParallel dp(model, group);
        mlp::Sgd opt(0.05f, 0.9f);
        const int global = replicas * micro_batch;
        for (int s = 0; s < steps; ++s) {
            const auto first = static_cast<std::size_t>(s * global + group.rank() * micro_batch);
            const float loss = model.forward_backward(mlp::make_batch(data_seed(shard), first, micro_batch));
            dp.synchronize();
            opt.step(model);
            // A job-wide collective between the groups' steps: the loss summed over all four.
            std::vector<float> total = {loss};
            job.allreduce(std::span<float>(total));
            job_sums[static_cast<std::size_t>(me)].push_back(total[0]);
        }
        ended[static_cast<std::size_t>(me)] = weights_of(model);
    });
    for (int shard = 0; shard < shards; ++shard) {
        CAPTURE(shard);
        const auto single = gradsync_test::train_one_process(shard, replicas, steps, micro_batch);
        CHECK(relative_difference(ended[static_cast<std::size_t>(shard)], single) <= 1e-5);
        CHECK(ended[static_cast<std::size_t>(shard)] == ended[static_cast<std::size_t>(shard + shards)]);  // bitwise
    }
    // The two shards trained different models: no group's reduction reached the other.
    CHECK(relative_difference(ended[0], ended[1]) > 1e-2);
    for (int r = 1; r < 4; ++r) CHECK(job_sums[static_cast<std::size_t>(r)] == job_sums[0]);
}

TEST_CASE("process groups: a mismatch in one group fails that group only, and its messages name the group") {
    const std::vector<int> colours = {0, 1, 0, 1};
    auto groups = gradsync::LocalBackend::split(colours, {}, shard_group_name);
    std::vector<std::string> errors(4);
    std::vector<std::vector<float>> results(4);
    gradsync::spawn(4, [&](gradsync::LocalBackend& job) {
        const int me = job.rank();
        auto& group = groups[static_cast<std::size_t>(me)];
        // Group 1's second rank (job rank 3) reduces a longer tensor than its peer.
        std::vector<float> data(me == 3 ? 5 : 4, float(me + 1));
        try {
            group.allreduce(std::span<float>(data));
            results[static_cast<std::size_t>(me)] = data;
        } catch (const gradsync::CollectiveError& e) {
            errors[static_cast<std::size_t>(me)] = e.what();
        }
    });
    CHECK(errors[0].empty());
    CHECK(errors[2].empty());
    CHECK(results[0] == std::vector<float>(4, 1.0f + 3.0f));
    CHECK(results[2] == results[0]);
    for (const int r : {1, 3}) {
        CAPTURE(errors[static_cast<std::size_t>(r)]);
        CHECK(errors[static_cast<std::size_t>(r)].find("collective mismatch") != std::string::npos);
        const std::string who =
            "gradsync: rank " + std::to_string(r / 2) + " of the group \"replicas of shard 1\" (job ranks 1, 3)";
        CHECK(errors[static_cast<std::size_t>(r)].rfind(who, 0) == 0);
    }
}

TEST_CASE("process groups: DataParallel's own messages name the group") {
    const std::vector<int> colours = {0, 0, 1, 1};  // blocks this time: job ranks {0, 1} and {2, 3}
    auto groups = gradsync::LocalBackend::split(colours);
    std::vector<std::string> errors(4);
    gradsync::spawn(4, [&](gradsync::LocalBackend& job) {
        const int me = job.rank();
        auto& group = groups[static_cast<std::size_t>(me)];
        mlp::Mlp model(1);
        gradsync::DataParallel dp(model, group);
        try {
            dp.grad_ready("no such parameter");
        } catch (const gradsync::Error& e) {
            errors[static_cast<std::size_t>(me)] = e.what();
        }
    });
    for (int r = 0; r < 4; ++r) {
        CAPTURE(errors[static_cast<std::size_t>(r)]);
        const std::string who = "gradsync: rank " + std::to_string(r % 2) + " of the group of job ranks " +
                                (r < 2 ? "0, 1" : "2, 3") + ", step ";
        CHECK(errors[static_cast<std::size_t>(r)].rfind(who, 0) == 0);
        CHECK(errors[static_cast<std::size_t>(r)].find("no such parameter") != std::string::npos);
    }
}

TEST_CASE("process groups: one colour for every rank is the whole job, named as before") {
    const std::vector<int> colours = {5, 5, 5};
    auto groups = gradsync::LocalBackend::split(colours, {}, shard_group_name);
    REQUIRE(groups.size() == 3);
    for (int r = 0; r < 3; ++r) {
        CHECK(groups[static_cast<std::size_t>(r)].rank() == r);
        CHECK(groups[static_cast<std::size_t>(r)].size() == 3);
        CHECK(groups[static_cast<std::size_t>(r)].group().whole_job());
        CHECK(groups[static_cast<std::size_t>(r)].group().who(r) == "gradsync: rank " + std::to_string(r));
    }
    CHECK_THROWS_WITH_AS(gradsync::LocalBackend::split(std::vector<int>{}),
                         "gradsync: LocalBackend::split needs the colour of at least 1 rank", gradsync::Error);
}

TEST_CASE("process groups: a label lists a large group's job ranks in short") {
    std::vector<int> ranks;
    for (int r = 0; r < 128; ++r) ranks.push_back(8 * r + 3);
    const auto label = gradsync::group_label("", ranks, 1024);
    CHECK(label.describe() == "the group of job ranks 3, 11, 19, 27, 35, 43, ... 1019 (128 ranks)");
    CHECK(gradsync::group_label("x", {0, 1}, 2).whole_job());
    CHECK_FALSE(gradsync::group_label("x", {1, 0}, 2).whole_job());  // renumbered: worth naming
    CHECK(gradsync::group_label("x", {1, 0}, 2).who(0) == "gradsync: rank 0 of the group \"x\" (job ranks 1, 0)");
}

}  // namespace process_groups
