// Where this process stands: rank, world size and local rank, from the launcher's environment
// (torchrun / memtrain-run: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
// Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; Open MPI: OMPI_COMM_WORLD_*). No variables: a
// single process.
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

}  // namespace memtrain
