// nccl_place_from_environment(): rank, GPU and NCCL's unique id from a launcher's variables.
// Runs without a GPU: the device count is handed in, and an id from NCCL_COMM_ID opens nothing.
#include <gradsync/backend/nccl/place.hpp>

#include <doctest/doctest.h>

#include "support/fake_env.hpp"

#include <cstdlib>  // for unsetenv
#include <cstring>
#include <map>
#include <optional>
#include <string>

namespace {

gradsync::NcclPlace place(std::map<std::string, std::string> env, int devices = 8) {
    fake_env::variables = std::move(env);
    struct Unset {
        ~Unset() { unsetenv("NCCL_COMM_ID"); }
    } unset;
    return gradsync::detail::nccl_place_from(fake_env::lookup, devices,
                                             "no CUDA device: cudaErrorNoDevice (no device)");
}

std::string error_of(std::map<std::string, std::string> env, int devices = 8) {
    try {
        place(std::move(env), devices);
    } catch (const gradsync::Error& e) {
        return e.what();
    }
    return "";
}

bool same(const ncclUniqueId& a, const ncclUniqueId& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

std::map<std::string, std::string> torchrun(int rank, int local_rank) {
    return {{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "4"},          {"LOCAL_RANK", std::to_string(local_rank)},
            {"LOCAL_WORLD_SIZE", "2"},      {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
}

}  // namespace

TEST_CASE("torchrun's variables: the rank, its GPU, and the same id on every rank without an exchange") {
    const auto r0 = place(torchrun(0, 0));
    const auto r3 = place(torchrun(3, 1));
    CHECK(r0.place == gradsync::ProcessPlace{0, 4, 0, 2, "RANK/WORLD_SIZE"});
    CHECK(r3.place.rank == 3);
    CHECK(r0.device == 0);
    CHECK(r3.device == 1);
    CHECK(r0.comm_id == "127.0.0.1:29501");  // torchrun's store has MASTER_PORT itself
    CHECK(same(r0.id, r3.id));
    CHECK_FALSE(same(r0.id, ncclUniqueId{}));
    auto elsewhere = torchrun(0, 0);
    elsewhere["MASTER_PORT"] = "29600";
    CHECK_FALSE(same(place(elsewhere).id, r0.id));  // another job, another id
}

TEST_CASE("each rank sees its own GPU through CUDA_VISIBLE_DEVICES: it drives that one, device 0") {
    auto env = torchrun(3, 1);
    env["CUDA_VISIBLE_DEVICES"] = "5";
    const auto p = place(env, 1);
    CHECK(p.device == 0);
    CHECK(p.place.local_rank == 1);
    auto all = torchrun(2, 0);  // every GPU visible to every rank: LOCAL_RANK picks
    all["CUDA_VISIBLE_DEVICES"] = "4,5";
    CHECK(place(all, 2).device == 0);
    all["LOCAL_RANK"] = "1";
    CHECK(place(all, 2).device == 1);
}

TEST_CASE("NCCL_COMM_ID, when given, is the address") {
    auto env = torchrun(1, 1);
    env["NCCL_COMM_ID"] = "127.0.0.1:4000";
    const auto p = place(env);
    CHECK(p.comm_id == "127.0.0.1:4000");
    env.erase("MASTER_ADDR");
    env.erase("MASTER_PORT");
    CHECK(same(place(env).id, p.id));
}

TEST_CASE("a world of one needs no address") {
    const auto p = place({});
    CHECK(p.place.world_size == 1);
    CHECK(p.comm_id.empty());
    CHECK_FALSE(same(p.id, ncclUniqueId{}));
}

TEST_CASE("missing or bad variables, no GPU, and more ranks than GPUs are errors that say what to do") {
    auto no_address = torchrun(2, 0);
    no_address.erase("MASTER_PORT");
    CHECK(error_of(no_address) ==
          "gradsync: rank 2 of 4 (RANK/WORLD_SIZE) has no address to meet the other ranks at: set MASTER_ADDR and "
          "MASTER_PORT (torchrun does; NCCL listens on MASTER_PORT + 1), or NCCL_COMM_ID=host:port");
    auto bad_port = torchrun(0, 0);
    bad_port["MASTER_PORT"] = "65535";
    CHECK(error_of(bad_port).find("MASTER_PORT=65535 is not a port from 1 to 65534") != std::string::npos);
    CHECK(error_of(torchrun(0, 0), 0) ==
          "gradsync: rank 0 of 4 (RANK/WORLD_SIZE) needs a CUDA device: no CUDA device: cudaErrorNoDevice (no device)");
    auto shared = torchrun(1, 1);  // two local ranks, two GPUs visible to neither: one
    CHECK(error_of(shared, 1) ==
          "gradsync: rank 1 of 4 (RANK/WORLD_SIZE): 2 ranks on this machine but 1 CUDA device visible: ranks "
          "would share a GPU, which NCCL does not allow. Start one rank per GPU, or give each rank its own GPU "
          "through CUDA_VISIBLE_DEVICES.");
    auto fewer = torchrun(1, 1);  // 2 GPUs visible to each of 4 local ranks
    fewer["LOCAL_WORLD_SIZE"] = "4";
    fewer["CUDA_VISIBLE_DEVICES"] = "0,1";
    CHECK(error_of(fewer, 2).find("4 ranks on this machine but 2 CUDA devices visible (CUDA_VISIBLE_DEVICES=0,1)") !=
          std::string::npos);
    auto disagree = torchrun(1, 1);
    disagree["OMPI_COMM_WORLD_RANK"] = "2";
    disagree["OMPI_COMM_WORLD_SIZE"] = "8";  // more processes than the torchrun inside it has
    CHECK(error_of(disagree).find("the launchers' variables disagree") != std::string::npos);
    auto malformed = torchrun(0, 0);
    malformed["NCCL_COMM_ID"] = "not an address";
    const auto why = error_of(malformed);
    CHECK(why.find("gradsync: rank 0 of 4 (RANK/WORLD_SIZE): ncclGetUniqueId failed: invalid argument") == 0);
    CHECK(why.find("(Invalid NCCL_COMM_ID") != std::string::npos);
    CHECK(why.find("NCCL_COMM_ID=not an address") != std::string::npos);
}

TEST_CASE("paddle.distributed.launch's variables: the rank, the GPU it chose, and rank 0's endpoint as the address") {
    std::map<std::string, std::string> env{
        {"PADDLE_TRAINER_ID", "3"},
        {"PADDLE_TRAINERS_NUM", "4"},
        {"PADDLE_RANK_IN_NODE", "1"},
        {"PADDLE_LOCAL_SIZE", "2"},
        {"PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:6170,127.0.0.1:6171,127.0.0.2:6170,127.0.0.2:6171"},
        {"PADDLE_CURRENT_ENDPOINT", "127.0.0.2:6171"},
        {"FLAGS_selected_gpus", "5"}};  // --gpus 4,5: the second process of the machine drives GPU 5
    const auto r3 = place(env);
    CHECK(r3.place == gradsync::ProcessPlace{3, 4, 1, 2, "PADDLE_TRAINER_ID/PADDLE_TRAINERS_NUM"});
    CHECK(r3.device == 5);
    CHECK(r3.comm_id == "127.0.0.1:6170");
    env["PADDLE_TRAINER_ID"] = "0";
    env["PADDLE_RANK_IN_NODE"] = "0";
    env["FLAGS_selected_gpus"] = "4";
    const auto r0 = place(env);
    CHECK(r0.device == 4);
    CHECK(same(r0.id, r3.id));
    env["FLAGS_selected_gpus"] = "8";
    CHECK(error_of(env) ==
          "gradsync: rank 0 of 4 (PADDLE_TRAINER_ID/PADDLE_TRAINERS_NUM): FLAGS_selected_gpus=8, but this process "
          "sees 8 CUDA devices");
    env["FLAGS_selected_gpus"] = "5";
    env["CUDA_VISIBLE_DEVICES"] = "4,5";  // GPU 5 is the second this process sees
    CHECK(place(env, 2).device == 1);
    env.erase("CUDA_VISIBLE_DEVICES");
    env.erase("FLAGS_selected_gpus");  // every GPU visible and none chosen: the local rank picks
    CHECK(place(env).device == 0);
    env["PADDLE_TRAINER_ENDPOINTS"] = "6170";
    CHECK(error_of(env).find("PADDLE_TRAINER_ENDPOINTS='6170' does not begin with an address:port") !=
          std::string::npos);
}
