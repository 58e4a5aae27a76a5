// MpiBackend over groups of the job's ranks (split communicators), under mpirun with 2, 3 and 4
// processes: a DataParallel over a group is one data-parallel dimension of a larger job; two levels
// (nodes, then across them) for the allreduce and for hybrid sharding.
#include <doctest/doctest.h>

#include <gradsync/backend/mpi.hpp>
#include <gradsync/gradsync.hpp>

#include "mlp.hpp"
#include "support/shard_training.hpp"
#include "support/sharded_optimizers.hpp"
#include "support/sharded_training.hpp"

#include <cmath>
#include <cstdlib>  // for std::getenv, std::atoi
#include <cstdint>
#include <string>
#include <vector>

using namespace gradsync::literals;

namespace {

using gradsync_test::data_seed;
using gradsync_test::model_seed;
using gradsync_test::relative_difference;
using gradsync_test::Weights;
using gradsync_test::weights_of;

constexpr int steps = 8;
constexpr int micro_batch = 8;

int job_rank() {
    int r = 0;
    MPI_Comm_rank(gradsync::mpi_world(), &r);
    return r;
}
int job_size() {
    int n = 1;
    MPI_Comm_size(gradsync::mpi_world(), &n);
    return n;
}

// Under scripts/nodes.py the ranks sit on GRADSYNC_TEST_NODES machines; under plain mpirun, one.
int test_nodes() {
    const char* nodes = std::getenv("GRADSYNC_TEST_NODES");
    return nodes ? std::atoi(nodes) : 1;
}

// The job ranks of colour `shard` when ranks are coloured by parity.
std::string parity_ranks(int shard) {
    std::string out;
    for (int r = shard; r < job_size(); r += 2) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
}

// This job rank's slice of step s's global batch (micro_batch examples of each rank's).
mlp::Batch job_batch(int s) {
    return mlp::make_batch(data_seed(0), static_cast<std::size_t>((s * job_size() + job_rank()) * micro_batch),
                           micro_batch);
}

// DataParallel over `backend`: each rank starts from weights of its own (rank 0's are broadcast)
// and trains on its slice of every global batch. Returns the weights after `steps` steps.
template <class Backend>
Weights train_data_parallel(Backend& backend) {
    mlp::Mlp model(model_seed(0) + static_cast<std::uint64_t>(job_rank()) * 1000);
    gradsync::DataParallel dp(model, backend, gradsync::SizeCappedBuckets{64_KiB, 4_KiB});
    mlp::Sgd opt(0.05f, 0.9f);
    for (int s = 0; s < steps; ++s) {
        model.forward_backward(job_batch(s));
        dp.synchronize();
        opt.step(model);
    }
    return weights_of(model);
}

// An allreduce of `count` elements over `backend`, each the sum over the job of a value of its rank's.
template <class Backend>
void check_job_sums(Backend& backend, std::size_t count) {
    const int n = job_size(), me = job_rank();
    std::vector<float> sums(count);
    for (std::size_t i = 0; i < sums.size(); ++i) sums[i] = float((me + 1) * int(1 + i % 7));
    backend.allreduce(std::span<float>(sums));
    for (std::size_t i = 0; i < sums.size(); ++i) REQUIRE(sums[i] == float(n * (n + 1) / 2 * int(1 + i % 7)));
}

}  // namespace

TEST_CASE("process groups over MPI: groups by rank parity, each == one process on its global batch") {
    const int me = job_rank();
    const int shard = me % 2;  // the "model shard" this rank holds
    const int replicas = (job_size() - shard + 1) / 2;
    // [groups]
    gradsync::MpiBackend job;
    gradsync::MpiBackend group(gradsync::mpi_split(gradsync::mpi_world(), shard),
                               {.group_name = "shard " + std::to_string(shard)});
    // [/groups]
    REQUIRE(group.size() == replicas);
    CHECK(group.rank() == me / 2);
    mlp::Mlp model(model_seed(shard) + static_cast<std::uint64_t>(group.rank()) * 1000);
    gradsync::DataParallel dp(model, group, gradsync::SizeCappedBuckets{64_KiB, 4_KiB});
    mlp::Sgd opt(0.05f, 0.9f);
    const int global = replicas * micro_batch;
    std::vector<float> job_losses;
    for (int s = 0; s < steps; ++s) {
        const auto first = static_cast<std::size_t>(s * global + group.rank() * micro_batch);
        std::vector<float> loss = {model.forward_backward(mlp::make_batch(data_seed(shard), first, micro_batch))};
        dp.synchronize();
        opt.step(model);
        job.allreduce(std::span<float>(loss));  // a job-wide collective between the groups' steps
        job_losses.push_back(loss[0]);
    }
    CHECK(relative_difference(weights_of(model),
                              gradsync_test::train_one_process(shard, replicas, steps, micro_batch)) <= 1e-5);
    // Every rank summed the same losses over the whole job.
    std::vector<float> rank0 = job_losses;
    MPI_Bcast(rank0.data(), static_cast<int>(rank0.size()), MPI_FLOAT, 0, gradsync::mpi_world());
    CHECK(rank0 == job_losses);
}

TEST_CASE("MpiBackend over a group: its label lists the job ranks, and its errors name the group") {
    const int me = job_rank();
    const int shard = me % 2;
    gradsync::MpiBackend group(gradsync::mpi_split(gradsync::mpi_world(), shard), {.group_name = "odd or even"});
    const bool whole = job_size() == 1;
    CHECK(group.group().whole_job() == whole);
    const std::string who = "gradsync: rank " + std::to_string(me / 2) + " of the group \"odd or even\" (job ranks " +
                            parity_ranks(shard) + ")";
    CHECK(group.group().who(group.rank()) == who);
    std::vector<std::byte> bytes(4);
    try {
        group.broadcast(std::span<std::byte>(bytes), group.size());  // no such root in the group
        FAIL("a broadcast from outside the group was accepted");
    } catch (const gradsync::CollectiveError& e) {
        CHECK(std::string(e.what()).rfind(who + ": broadcast from rank", 0) == 0);
    }
    // The whole job's backend is named as before.
    gradsync::MpiBackend job;
    CHECK(job.group().whole_job());
}

TEST_CASE("nodes stated for a test, and each rank's peers across them") {
    const int n = job_size(), me = job_rank();
    const int per_node = n % 2 == 0 ? 2 : 1;
    auto node = gradsync::mpi_node_comm(gradsync::mpi_world(), per_node);
    CHECK(node.size() == per_node);
    CHECK(node.rank() == me % per_node);
    auto across = gradsync::mpi_cross_node_comm(gradsync::mpi_world(), node);
    CHECK(across.size() == n / per_node);
    CHECK(across.rank() == me / per_node);
    // Found rather than stated: the machines the test runs on (one, but under scripts/nodes.py).
    auto machine = gradsync::mpi_node_comm();
    CHECK(machine.size() == n / test_nodes());
    CHECK_THROWS_WITH_AS(gradsync::mpi_node_comm(gradsync::mpi_world(), n + 1),
                         ("gradsync: mpi_node_comm: " + std::to_string(n + 1) + " ranks per node do not divide " +
                          std::to_string(n) + " ranks into whole nodes")
                             .c_str(),
                         gradsync::Error);
    if (n >= 3) {
        // Nodes of different sizes (rank 0 alone, the rest together): refused on every rank.
        auto uneven = gradsync::mpi_split(gradsync::mpi_world(), me == 0 ? 0 : 1);
        CHECK_THROWS_AS(gradsync::mpi_cross_node_comm(gradsync::mpi_world(), uneven), gradsync::Error);
    }
}

TEST_CASE("two levels over MPI: nodes stated as blocks of ranks; DataParallel == one process with the whole batch") {
    const int n = job_size(), me = job_rank();
    const int per_node = n % 2 == 0 ? 2 : 1;
    // [two-level]
    auto node_comm = gradsync::mpi_node_comm(gradsync::mpi_world(), per_node);
    auto across_comm = gradsync::mpi_cross_node_comm(gradsync::mpi_world(), node_comm);
    gradsync::MpiBackend node(node_comm, {.group_name = "node " + std::to_string(me / per_node)});
    gradsync::MpiBackend across(across_comm, {.group_name = "place " + std::to_string(me % per_node)});
    gradsync::TwoLevelBackend backend(node, across);
    // [/two-level]
    CHECK(backend.rank() == me);  // numbered node by node, as the job is
    CHECK(backend.size() == n);

    check_job_sums(backend, 1001);
    CHECK(relative_difference(train_data_parallel(backend),
                              gradsync_test::train_one_process(0, n, steps, micro_batch)) <= 1e-5);
    CHECK(backend.elements_across() <= backend.elements_reduced() / static_cast<std::uint64_t>(per_node) + 64);
}

TEST_CASE("nodes found by MPI: a TwoLevelBackend over them trains as the flat backend does") {
    const int n = job_size(), me = job_rank(), nodes = test_nodes();
    auto node_comm = gradsync::mpi_node_comm();
    REQUIRE(node_comm.size() == n / nodes);
    auto across_comm = gradsync::mpi_cross_node_comm(gradsync::mpi_world(), node_comm);
    CHECK(across_comm.size() == nodes);
    gradsync::MpiBackend node(node_comm), across(across_comm), flat;
    gradsync::TwoLevelBackend two_level(node, across);
    CHECK(two_level.rank() == me);  // launchers place ranks node by node

    auto train = [](auto& backend) { return train_data_parallel(backend); };
    const auto single = gradsync_test::train_one_process(0, n, steps, micro_batch);
    CHECK(relative_difference(train(flat), single) <= 1e-5);
    CHECK(relative_difference(train(two_level), single) <= 1e-5);
    // Between nodes, each rank handed on its node's share only.
    const auto per_node = static_cast<std::uint64_t>(node.size());
    CHECK(two_level.elements_across() * per_node <= two_level.elements_reduced() + per_node * 64);

    // A job numbered round-robin across the nodes (a cyclic placement): the two levels number
    // their ranks node by node all the same, and train alike.
    const int per = n / nodes;
    auto cyclic = gradsync::mpi_split(gradsync::mpi_world(), 0, (me % per) * nodes + me / per);
    auto cyclic_node = gradsync::mpi_node_comm(cyclic);
    auto cyclic_across = gradsync::mpi_cross_node_comm(cyclic, cyclic_node);
    gradsync::MpiBackend node2(cyclic_node), across2(cyclic_across);
    gradsync::TwoLevelBackend reordered(node2, across2);
    CHECK(relative_difference(train(reordered), single) <= 1e-5);
}

TEST_CASE("shared memory inside nodes, MPI across them: TwoLevelBackend trains as the flat backend does") {
    const int n = job_size(), me = job_rank();
    // [shared-memory-node]
    auto node_comm = gradsync::mpi_node_comm();
    auto across_comm = gradsync::mpi_cross_node_comm(gradsync::mpi_world(), node_comm);
    auto node = gradsync::shared_memory_group(node_comm);
    gradsync::MpiBackend across(across_comm);
    gradsync::TwoLevelBackend backend(*node, across);
    // [/shared-memory-node]
    CHECK(node->size() == n / test_nodes());
    CHECK(backend.rank() == me);

    check_job_sums(backend, 100'001);
    CHECK(relative_difference(train_data_parallel(backend),
                              gradsync_test::train_one_process(0, n, steps, micro_batch)) <= 1e-5);

    // The whole job over shared memory, where it runs on one machine.
    if (test_nodes() == 1) {
        auto whole = gradsync::shared_memory_group(gradsync::mpi_world());
        std::vector<float> v(5000, float(me));
        whole->allreduce(std::span<float>(v), gradsync::ReduceOp::average);
        CHECK(v[4999] == float(n - 1) / 2.0f);
    } else {
        CHECK_THROWS_WITH_AS(gradsync::shared_memory_group(gradsync::mpi_world()),
                             doctest::Contains("are not all on one machine"), gradsync::Error);
    }
}

TEST_CASE("hybrid sharding over nodes: the state split in each node, the same on every node, as DataParallel trains") {
    const int n = job_size(), me = job_rank();
    const int per_node = n % 2 == 0 ? 2 : 1;
    // [hybrid]
    auto node_comm = gradsync::mpi_node_comm(gradsync::mpi_world(), per_node);
    auto across_comm = gradsync::mpi_cross_node_comm(gradsync::mpi_world(), node_comm);
    gradsync::MpiBackend node(node_comm), across(across_comm);
    gradsync::TwoLevelBackend backend(node, across);
    // [/hybrid]
    const gradsync::SizeCappedBuckets caps{64_KiB, 4_KiB};
    const Weights unsharded = train_data_parallel(backend);
    for (const bool release : {false, true}) {
        CAPTURE(release);
        sharded::ReleasingMlp model(model_seed(0) + static_cast<std::uint64_t>(me) * 1000);
        gradsync::ShardedDataParallel sdp(model, backend, caps, gradsync::ShardedOptions{.release_gradients = release});
        CHECK(sdp.shard_ranks() == per_node);
        CHECK(sdp.shard_rank() == me % per_node);
        // [hybrid-state]
        sharded::ShardedSgd opt{.lr = 0.05f, .momentum = 0.9f, .velocity = {}};
        opt.velocity.assign(sdp.state_elements(), 0.0f);  // a node's share: 1/per_node of the model
        // [/hybrid-state]
        CHECK(sdp.state_elements() * static_cast<std::size_t>(per_node) <=
              sdp.parameter_elements() + static_cast<std::size_t>(per_node) * 8);
        model.on_grad_ready = [&](std::size_t i) { sdp.grad_ready(i); };  // reduced during backward
        for (int s = 0; s < steps; ++s) {
            model.forward_backward(job_batch(s));
            CHECK(sdp.step(opt).applied);
        }
        // The same sums in the same order (each node's first): DataParallel's bits.
        CHECK(gradsync_test::weights_of(model) == unsharded);
    }
    CHECK(relative_difference(unsharded, gradsync_test::train_one_process(0, n, steps, micro_batch)) <= 1e-5);
}

TEST_CASE("nodes from the launcher's places: blocks of ranks, checked on every rank") {
    const int n = job_size(), me = job_rank();
    // Open MPI's own variables (or the launcher's that started the test): the machines it runs on.
    const auto launcher = gradsync::process_place();
    if (launcher.rank == me && launcher.world_size == n) {
        auto found = gradsync::mpi_node_comm(gradsync::mpi_world(), launcher);
        CHECK(found.size() == n / test_nodes());
        CHECK(found.rank() == launcher.local_rank);
    }
    // Stated for a test: nodes of 2 (or 1).
    const int per_node = n % 2 == 0 ? 2 : 1;
    const gradsync::ProcessPlace blocks{me, n, me % per_node, per_node, "stated"};
    auto node = gradsync::mpi_node_comm(gradsync::mpi_world(), blocks);
    CHECK(node.size() == per_node);
    CHECK(node.rank() == me % per_node);
    // A launcher numbering other than the communicator's: every rank throws.
    const gradsync::ProcessPlace shifted{(me + 1) % n, n, 0, 1, "shifted"};
    if (n > 1)
        CHECK_THROWS_WITH_AS(gradsync::mpi_node_comm(gradsync::mpi_world(), shifted),
                             "gradsync: mpi_node_comm: rank 0 of this communicator is rank 1 to its launcher: the "
                             "launcher's places describe another numbering (give the places for the job's own "
                             "communicator, mpi_world())",
                             gradsync::Error);
    if (n == 4) {
        // Round robin over 2 nodes: local ranks 0, 0, 1, 1 of 2 are not blocks.
        const gradsync::ProcessPlace round_robin{me, n, me / 2, 2, "round robin"};
        CHECK_THROWS_WITH_AS(gradsync::mpi_node_comm(gradsync::mpi_world(), round_robin),
                             doctest::Contains("the launcher's places are not blocks of consecutive ranks: rank 0 "
                                               "says it is local rank 0 of 2"),
                             gradsync::Error);
    }
}
