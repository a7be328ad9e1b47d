#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/distributed/parallel_dims.h"
#include "memtrain/distributed/world.h"
#include "memtrain/core/error.h"

namespace memtrain {
namespace {

// The run's degrees, from dist.* and the world: a stage is what runs. One process shards nothing unless the optimizer
// is offloaded (a group of one); several ranks shard at the configured stage; tensor parallelism is 1 until it exists.
TEST(ParallelDims, AStageIsWhatRuns) {
  DistConfig d;
  d.zero_stage = 3;
  auto one = ParallelDims::of(d, 1);
  EXPECT_FALSE(one.sharded());
  EXPECT_EQ(one.zero_stage, 0);
  EXPECT_FALSE(one.gathers_parameters());
  d.offload_optimizer = "cpu";
  auto offloaded = ParallelDims::of(d, 1);
  EXPECT_TRUE(offloaded.sharded());
  EXPECT_TRUE(offloaded.gathers_parameters());
  d.offload_optimizer = "none", d.zero_stage = 2;
  auto four = ParallelDims::of(d, 4);
  EXPECT_EQ(four.dp, 4);
  EXPECT_EQ(four.tp, 1);
  EXPECT_TRUE(four.shards_gradients());
  EXPECT_FALSE(four.gathers_parameters());
  EXPECT_EQ(four.describe(), "4 ranks: data parallel 4, ZeRO stage 2");
}

TEST(World, NoLauncherIsOneProcess) {
  auto w = World::from_env(std::map<std::string, std::string>{});
  EXPECT_EQ(w.rank, 0);
  EXPECT_EQ(w.world_size, 1);
  EXPECT_EQ(w.launcher, "none");
  EXPECT_TRUE(w.is_main());
}

TEST(World, TorchrunVariables) {
  auto w = World::from_env({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                            {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29501"}});
  EXPECT_EQ(w.launcher, "torchrun");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 2);
  EXPECT_EQ(w.master_addr, "10.0.0.1");
  EXPECT_EQ(w.master_port, 29501);
  EXPECT_FALSE(w.is_main());
}

TEST(World, SlurmAndMpiVariables) {
  auto s = World::from_env({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(s.launcher, "slurm");
  EXPECT_EQ(s.rank, 2);
  auto m = World::from_env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(m.launcher, "mpi");
  EXPECT_EQ(m.local_rank, 1);
}

TEST(World, SlurmNodeListsGiveTheFirstHost) {
  EXPECT_EQ(first_slurm_host("node[01-04,07]"), "node01");
  EXPECT_EQ(first_slurm_host("node[07,01-04]"), "node07");
  EXPECT_EQ(first_slurm_host("gpu-a[7,9],gpu-b3"), "gpu-a7");
  EXPECT_EQ(first_slurm_host("login1,login2"), "login1");
  EXPECT_EQ(first_slurm_host("rack[1-2]-n[3]"), "rack1-n3");  // Slurm expands every bracket group
  EXPECT_EQ(first_slurm_host("r[2,1]-n[04-05]x,r9"), "r2-n04x");
  EXPECT_EQ(first_slurm_host("127.0.0.[1-2]"), "127.0.0.1");
}

TEST(World, SlurmWithoutMasterAddrRendezvousesOnTheFirstNode) {
  // srun sets no MASTER_ADDR or MASTER_PORT; SLURM_NTASKS_PER_NODE may read "2(x3)" (2 tasks on each of 3 nodes).
  auto w = World::from_env({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "1"},
                            {"SLURM_NTASKS_PER_NODE", "2(x3)"}, {"SLURM_JOB_NODELIST", "node[01-03]"}, {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 2);
  EXPECT_EQ(w.master_addr, "node01");
  EXPECT_EQ(w.master_port, 20000 + 123456 % 10000);
  // MASTER_ADDR and MASTER_PORT, when a batch script exports them, win.
  w = World::from_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "node[01-03]"},
                       {"MASTER_ADDR", "10.0.0.5"}, {"MASTER_PORT", "29400"}});
  EXPECT_EQ(w.master_addr, "10.0.0.5");
  EXPECT_EQ(w.master_port, 29400);
}

TEST(World, InconsistentValuesAreErrors) {
  auto msg = test::error_of([] { World::from_env({{"RANK", "4"}, {"WORLD_SIZE", "4"}}); });
  EXPECT_NE(msg.find("rank 4 is outside [0, 4)"), std::string::npos) << msg;
  msg = test::error_of([] { World::from_env({{"RANK", "x"}, {"WORLD_SIZE", "2"}}); });
  EXPECT_NE(msg.find("RANK='x' is not an integer"), std::string::npos) << msg;
  msg = test::error_of([] { World::from_env({{"RANK", "0"}}); });
  EXPECT_NE(msg.find("must be set together"), std::string::npos) << msg;
}

}  // namespace
}  // namespace memtrain
