#include "memtrain/distributed/world.h"

#include <cctype>
#include <cstdlib>
#include <optional>

#include "memtrain/core/error.h"

extern char** environ;

namespace memtrain {
namespace {

std::optional<int> read_int(const std::map<std::string, std::string>& env, const std::string& key) {
  auto it = env.find(key);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  try {
    size_t used = 0;
    int v = std::stoi(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (...) {
  }
  throw Error(detail::concat("[dist] environment variable ", key, "='", it->second, "' is not an integer"));
}

// The leading integer of a Slurm count such as SLURM_NTASKS_PER_NODE = "2(x3)" (2 tasks on each of 3 nodes).
std::optional<int> leading_int(const std::map<std::string, std::string>& env, const std::string& key) {
  auto it = env.find(key);
  if (it == env.end() || it->second.empty() || !std::isdigit(static_cast<unsigned char>(it->second[0]))) return std::nullopt;
  return std::stoi(it->second);
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first item of the top-level list (commas inside brackets belong to its ranges).
  std::string first;
  int depth = 0;
  for (char ch : nodelist) {
    if (ch == ',' && depth == 0) break;
    depth += ch == '[' ? 1 : ch == ']' ? -1 : 0;
    first += ch;
  }
  // prefix[range,...]infix[range,...]...: Slurm expands every bracket group, and the first host takes the first
  // number of each group's first range, as written (zero padding kept): rack[1-2]-n[3] -> rack1-n3.
  std::string host;
  for (size_t at = 0; at < first.size();) {
    const auto open = first.find('[', at);
    if (open == std::string::npos) {
      host += first.substr(at);
      break;
    }
    host += first.substr(at, open - at);
    const auto end = first.find_first_of(",-]", open + 1);
    host += first.substr(open + 1, (end == std::string::npos ? first.size() : end) - open - 1);
    const auto close = first.find(']', open);
    if (close == std::string::npos) break;
    at = close + 1;
  }
  return host;
}

World World::from_env() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return from_env(env);
}

World World::from_env(const std::map<std::string, std::string>& env) {
  World w;
  // torchrun's names first, then Slurm's, then Open MPI's.
  const char* schemes[][5] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
      {"mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
  };
  for (const auto& s : schemes) {
    auto rank = read_int(env, s[1]);
    auto size = read_int(env, s[2]);
    if (!rank && !size) continue;
    MEMTRAIN_CHECK(rank && size, Error, "[dist] ", s[1], " and ", s[2], " must be set together");
    w.launcher = s[0];
    w.rank = *rank;
    w.world_size = *size;
    w.local_rank = read_int(env, s[3]).value_or(w.rank);
    w.local_world_size = (w.launcher == "slurm" ? leading_int(env, s[4]) : read_int(env, s[4])).value_or(w.world_size);
    break;
  }
  MEMTRAIN_CHECK(w.world_size >= 1, Error, "[dist] world size must be >= 1, got ", w.world_size);
  MEMTRAIN_CHECK(w.rank >= 0 && w.rank < w.world_size, Error, "[dist] rank ", w.rank, " is outside [0, ", w.world_size,
                 ")");
  MEMTRAIN_CHECK(w.local_rank >= 0 && w.local_rank < w.local_world_size, Error, "[dist] local rank ", w.local_rank,
                 " is outside [0, ", w.local_world_size, ")");
  if (auto it = env.find("MASTER_ADDR"); it != env.end() && !it->second.empty()) {
    w.master_addr = it->second;
  } else if (w.launcher == "slurm") {  // srun sets no MASTER_ADDR: rank 0 runs on the job's first node
    for (const char* key : {"SLURM_JOB_NODELIST", "SLURM_NODELIST"})
      if (auto n = env.find(key); n != env.end() && !n->second.empty()) {
        w.master_addr = first_slurm_host(n->second);
        break;
      }
  }
  if (auto port = read_int(env, "MASTER_PORT")) {
    w.master_port = *port;
  } else if (w.launcher == "slurm") {  // a port of this job's own, so two jobs sharing a node do not collide
    if (auto job = leading_int(env, "SLURM_JOB_ID")) w.master_port = 20000 + *job % 10000;
  }
  MEMTRAIN_CHECK(w.master_port >= 1 && w.master_port <= 65535, Error, "[dist] MASTER_PORT=", w.master_port,
                 " is not a TCP port: expected 1 to 65535");
  return w;
}

}  // namespace memtrain
