// Where this process stands: rank, world size and local rank, from the launcher's environment
// (torchrun / memtrain-run: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
// Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, and without MASTER_ADDR the first
// host of SLURM_JOB_NODELIST, without MASTER_PORT 20000 + SLURM_JOB_ID % 10000; Open MPI: OMPI_COMM_WORLD_*).
// No variables: a single process.
//
//   auto world = memtrain::World::from_env();
//   if (world.is_main()) std::cout << config.to_ini();
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace memtrain {

struct World {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "none";  // none | torchrun | slurm | mpi

  bool is_main() const { return rank == 0; }
  // Reads the process environment; `env` replaces it in tests. Inconsistent values are an error.
  static World from_env();
  static World from_env(const std::map<std::string, std::string>& env);
};

// The first host of a Slurm node list, compressed as Slurm writes it: "node[01-04,07],gpu3" -> "node01"
// (zero padding kept), "127.0.0.[1-2]" -> "127.0.0.1", "login1" -> "login1".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace memtrain
