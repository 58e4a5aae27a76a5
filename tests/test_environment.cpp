// process_place(): rank, world size and local rank from the variables launchers set.
#include <gradsync/environment.hpp>

#include <doctest/doctest.h>

#include "support/fake_env.hpp"

#include <map>
#include <optional>
#include <string>

namespace {

gradsync::ProcessPlace place(std::map<std::string, std::string> env) {
    fake_env::variables = std::move(env);
    return gradsync::detail::place_from(fake_env::lookup);
}

}  // namespace

TEST_CASE("each launcher's variables give the process's place") {
    auto torchrun = place({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}});
    CHECK(torchrun == gradsync::ProcessPlace{5, 8, 1, 4, "RANK/WORLD_SIZE"});
    auto ompi = place({{"OMPI_COMM_WORLD_RANK", "2"},
                       {"OMPI_COMM_WORLD_SIZE", "3"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}});
    CHECK(ompi == gradsync::ProcessPlace{2, 3, 2, 3, "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE"});
    auto paddle = place({{"PADDLE_TRAINER_ID", "3"},
                         {"PADDLE_TRAINERS_NUM", "4"},
                         {"PADDLE_RANK_IN_NODE", "1"},
                         {"PADDLE_LOCAL_SIZE", "2"},
                         {"PADDLE_TRAINER_ENDPOINTS", "10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170,10.0.0.2:6171"},
                         {"PADDLE_CURRENT_ENDPOINT", "10.0.0.2:6171"}});
    CHECK(paddle == gradsync::ProcessPlace{3, 4, 1, 2, "PADDLE_TRAINER_ID/PADDLE_TRAINERS_NUM"});
    // Older paddle.distributed.launch sets no PADDLE_LOCAL_SIZE: at least this many on the machine.
    auto older = place({{"PADDLE_TRAINER_ID", "2"}, {"PADDLE_TRAINERS_NUM", "4"}, {"PADDLE_RANK_IN_NODE", "0"}});
    CHECK(older == gradsync::ProcessPlace{2, 4, 0, 1, "PADDLE_TRAINER_ID/PADDLE_TRAINERS_NUM"});
    auto pmi = place({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}});
    CHECK(pmi.rank == 0);
    CHECK(pmi.world_size == 2);
    auto slurm = place({{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "3"}});
    CHECK(slurm.rank == 7);
    CHECK(slurm.local_rank == 3);
    CHECK(slurm.local_world_size == 4);  // at least: Slurm's local size is not among its variables here
    auto alone = place({});
    CHECK(alone.rank == 0);
    CHECK(alone.world_size == 1);
}

TEST_CASE("nested launchers: the innermost one's variables win, and an outer world larger than the inner is an error") {
    auto both =
        place({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
    CHECK(both.source == "RANK/WORLD_SIZE");
    // torchrun inside srun: one Slurm task per node, torchrun's 4 processes on each of 2 nodes.
    auto torchrun_in_srun = place({{"SLURM_PROCID", "1"},
                                   {"SLURM_NTASKS", "2"},
                                   {"SLURM_LOCALID", "0"},
                                   {"RANK", "6"},
                                   {"WORLD_SIZE", "8"},
                                   {"LOCAL_RANK", "2"},
                                   {"LOCAL_WORLD_SIZE", "4"}});
    CHECK(torchrun_in_srun == gradsync::ProcessPlace{6, 8, 2, 4, "RANK/WORLD_SIZE"});
    // torchrun numbers its processes its own way: another rank than mpirun's is no mistake.
    CHECK(place({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}})
              .rank == 1);
    // mpirun inside srun.
    CHECK(place({{"SLURM_PROCID", "0"},
                 {"SLURM_NTASKS", "1"},
                 {"OMPI_COMM_WORLD_RANK", "3"},
                 {"OMPI_COMM_WORLD_SIZE", "4"}})
              .source == "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE");
    // RANK left over in the shell that ran mpirun -np 4: every process would be rank 0 of 1.
    CHECK_THROWS_WITH_AS(
        place({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}}),
        doctest::Contains("the launchers' variables disagree: RANK/WORLD_SIZE say rank 0 of 1, "
                          "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE say rank 3 of 4: more processes than the "
                          "launcher inside it starts. Are RANK/WORLD_SIZE left over"),
        gradsync::Error);
}

TEST_CASE("launcher variables that are incomplete or damaged are errors") {
    CHECK_THROWS_WITH_AS(place({{"RANK", "1"}}), doctest::Contains("RANK is set but WORLD_SIZE is not"),
                         gradsync::Error);
    CHECK_THROWS_WITH_AS(place({{"RANK", "4"}, {"WORLD_SIZE", "4"}}),
                         doctest::Contains("RANK=4 is not a rank of WORLD_SIZE=4"), gradsync::Error);
    CHECK_THROWS_WITH_AS(place({{"RANK", "one"}, {"WORLD_SIZE", "4"}}),
                         doctest::Contains("RANK='one' is not a non-negative whole number"), gradsync::Error);
    CHECK_THROWS_WITH_AS(place({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
                         doctest::Contains("local rank 2 from LOCAL_RANK is not below the local world size 2"),
                         gradsync::Error);
}

TEST_CASE("a launcher's local rank and local world size are checked against where the processes lie") {
    const gradsync::ProcessPlace mpi{5, 8, 1, 4, "MPI"};
    // torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE as MPI finds them: no problem.
    auto launcher = place({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}});
    CHECK(gradsync::detail::local_place_problem(launcher, mpi, fake_env::lookup).empty());
    // Two torchruns of 2 on one machine: each says 2 here, MPI finds 4.
    launcher = place({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}});
    CHECK(gradsync::detail::local_place_problem(launcher, mpi, fake_env::lookup) ==
          "gradsync: LOCAL_RANK/LOCAL_WORLD_SIZE say local rank 1 of 2 on this machine, but MPI finds 4 processes "
          "of the job here, this one local rank 1: a GPU chosen by LOCAL_RANK could be another process's too. "
          "Start one launcher per machine, or set LOCAL_RANK and LOCAL_WORLD_SIZE as the processes lie");
    // Another local rank, the same size.
    launcher = place({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "4"}});
    CHECK(gradsync::detail::local_place_problem(launcher, mpi, fake_env::lookup).find("say local rank 3 of 4") !=
          std::string::npos);
    // paddle.distributed.launch's, checked alike.
    launcher = place({{"PADDLE_TRAINER_ID", "5"},
                      {"PADDLE_TRAINERS_NUM", "8"},
                      {"PADDLE_RANK_IN_NODE", "0"},
                      {"PADDLE_LOCAL_SIZE", "4"}});
    CHECK(gradsync::detail::local_place_problem(launcher, mpi, fake_env::lookup)
              .starts_with("gradsync: PADDLE_RANK_IN_NODE/PADDLE_LOCAL_SIZE say local rank 0 of 4"));
    // Not said, not checked: no local variables, or only a local rank (Slurm has no local size here).
    launcher = place({{"RANK", "5"}, {"WORLD_SIZE", "8"}});
    CHECK(gradsync::detail::local_place_problem(launcher, mpi, fake_env::lookup).empty());
    launcher = place({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"}});
    CHECK(gradsync::detail::local_place_problem(launcher, mpi, fake_env::lookup).empty());
}

TEST_CASE("RANK/WORLD_SIZE handed to every process that mpirun started are named as such") {
    const gradsync::ProcessPlace mpi{2, 4, 2, 4, "MPI"};
    const std::map<std::string, std::string> mpirun = {{"OMPI_COMM_WORLD_RANK", "2"},
                                                       {"OMPI_COMM_WORLD_SIZE", "4"},
                                                       {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
    auto env = mpirun;
    env.insert({{"RANK", "0"}, {"WORLD_SIZE", "4"}});
    auto launcher = place(env);
    CHECK(launcher.source == "RANK/WORLD_SIZE");  // the innermost launcher's, as ever
    CHECK(gradsync::detail::exported_rank_problem(launcher, mpi, fake_env::lookup) ==
          "gradsync: RANK/WORLD_SIZE say rank 0 of 4, but an MPI launcher started this process as rank 2 of 4 "
          "(OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE): RANK/WORLD_SIZE were given to every process (exported in "
          "the shell, or passed with mpirun -x). Unset them when starting with mpirun, or start the processes with "
          "torchrun alone");
    // Agreeing with MPI, or mpirun's own variables, or no MPI launcher at all: no such problem.
    env["RANK"] = "2";
    CHECK(gradsync::detail::exported_rank_problem(place(env), mpi, fake_env::lookup).empty());
    CHECK(gradsync::detail::exported_rank_problem(place(mpirun), mpi, fake_env::lookup).empty());
    launcher = place({{"RANK", "0"}, {"WORLD_SIZE", "4"}});
    CHECK(gradsync::detail::exported_rank_problem(launcher, mpi, fake_env::lookup).empty());
}
