// Multi-process runs on this machine: memtrain-run (and PyTorch's torchrun) start N ranks of a probe
// that checks every collective against arithmetic; a rank that dies stops the job; a rendezvous that
// cannot complete fails within its timeout.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <regex>

#include "helpers.h"

namespace memtrain {
namespace {

struct Run {
  int code = -1;
  std::string output;
  double seconds = 0;
};

// Runs a shell command, capturing stdout and stderr together, and times it.
Run run(const std::string& command) {
  Run r;
  auto start = std::chrono::steady_clock::now();
  r.output = test::shell(command + " 2>&1", &r.code);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

std::string probe() { return test::binary("tests/memtrain_collectives_probe"); }
std::string launcher() { return test::binary("memtrain-run"); }

TEST(Launcher, TwoAndFourRanksGetExactCollectives) {
  for (int n : {2, 4}) {
    auto r = run(launcher() + " --standalone --nproc-per-node " + std::to_string(n) + " -- " + probe());
    EXPECT_EQ(r.code, 0) << r.output;
    for (int rank = 0; rank < n; ++rank)
      EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "] collectives ok: rank " + std::to_string(rank) +
                              " of " + std::to_string(n) + " (gloo)"),
                std::string::npos)
          << r.output;
  }
}

TEST(Launcher, TwoNodesOnLoopbackFormOneJob) {
  // Two launchers, node 0 and node 1, two ranks each: one world of 4 through the loopback address.
  test::TempDir dir;
  const std::string common = " --nnodes 2 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port " +
                             std::to_string(test::free_port()) + " -- " + probe();
  const auto node1 = dir.path("node1.log");
  // Node 1 in the background; whatever node 0 does, node 1 is stopped and waited for before the test ends.
  auto r = run(launcher() + " --node-rank 1" + common + " > " + node1 + " 2>&1 & N1=$!; " + launcher() + " --node-rank 0" +
               common + "; c=$?; " + test::wait_at_most("$N1", 30) + "; cat " + node1 + "; exit $c");
  EXPECT_EQ(r.code, 0) << r.output;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(r.output.find("collectives ok: rank " + std::to_string(rank) + " of 4"), std::string::npos) << r.output;
}

TEST(Launcher, TwoRanksStartedAsSlurmStartsThemRendezvousOnTheFirstNode) {
  // As srun starts tasks: only Slurm's variables, no MASTER_ADDR; the node list's first host, 127.0.0.[1-2] ->
  // 127.0.0.1, is where rank 0 serves the store. The port, 20000 + SLURM_JOB_ID % 10000, from a job id chosen
  // to land on a free port.
  const int port = test::free_port_between(20000, 30000);
  const std::string slurm = "SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE='2(x1)' SLURM_JOB_NODELIST='127.0.0.[1-2]' SLURM_JOB_ID=" +
                            std::to_string(port - 20000) + " PROBE_TIMEOUT_S=30 ";
  auto r = run("(" + slurm + "SLURM_PROCID=1 SLURM_LOCALID=1 " + probe() + " & " + slurm + "SLURM_PROCID=0 SLURM_LOCALID=0 " +
               probe() + "; c=$?; wait; exit $c)");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("collectives ok: rank 0 of 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("collectives ok: rank 1 of 2"), std::string::npos) << r.output;
}

TEST(Launcher, TorchrunStartsTheSameRanks) {
  const auto torchrun = std::filesystem::path(MEMTRAIN_PYTHON).parent_path() / "torchrun";
  ASSERT_TRUE(std::filesystem::exists(torchrun)) << torchrun;
  auto r = run(torchrun.string() + " --no-python --standalone --nproc-per-node 2 " + probe());
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("collectives ok: rank 1 of 2"), std::string::npos) << r.output;
}

TEST(Launcher, ADeadRankStopsTheJobNamingItAndLeavesNoProcess) {
  // Rank 1 exits with code 3 right after the rendezvous. The job's end is timed from that event (its "dying on
  // purpose" line in the log), not from the launch: three ranks may take long to start on a busy machine, but
  // once one is dead the others must be stopped within the grace period (3 s) and a few seconds of polling.
  test::TempDir dir;
  const auto log = dir.path("job.log");
  auto r = run("PROBE_DIE_RANK=1 PROBE_PRINT_PID=1 PROBE_TIMEOUT_S=20 " + launcher() +
               " --standalone --nproc-per-node 3 --grace-s 3 -- " + probe() + " > " + log + " 2>&1 & L=$!; " +
               test::wait_for_line(log, "dying on purpose", 120) + "; t0=$(date +%s.%N); " + test::wait_at_most("$L", 120) +
               "; code=$?; t1=$(date +%s.%N); cat " + log + "; echo \"exit=$code\"; echo \"t0=$t0 t1=$t1\"");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("exit=([0-9]+)"))) << r.output;
  EXPECT_EQ(std::stoi(m[1]), 3) << r.output;  // the dead rank's own exit code
  EXPECT_NE(r.output.find("memtrain-run: rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3; stopping the other ranks"), std::string::npos) << r.output;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("t0=([0-9.]+) t1=([0-9.]+)"))) << r.output;
  EXPECT_LT(std::stod(m[2]) - std::stod(m[1]), 3 + 5) << "the job did not stop within the grace period of the rank's death:\n"
                                                      << r.output;
  std::string rest = r.output;
  int pids = 0;
  while (std::regex_search(rest, m, std::regex("pid (\\d+)\n"))) {
    EXPECT_NE(kill(std::stoi(m[1]), 0), 0) << "rank process " << m[1] << " is still alive";
    rest = m.suffix();
    ++pids;
  }
  EXPECT_EQ(pids, 3) << r.output;
}

TEST(Launcher, TorchrunAlsoStopsOnADeadRank) {
  // torchrun, not the survivor, must end the job. The survivors' own timeout is 120 s, so a job that ends well
  // before it was ended by torchrun. Two deaths:
  //  - after the rendezvous (rank 0, mid-job): the survivor's collective fails at once on the closed connection;
  //    torchrun must still name the dead rank and its code and exit non-zero;
  //  - before the rendezvous (rank 1): rank 0 waits at the store, where nothing tells it of the death, and would
  //    wait its full 120 s. Only torchrun's SIGTERM ends it: the survivor's exit is "-15" (killed by SIGTERM),
  //    never its own rendezvous error, and it obeyed the SIGTERM (no SIGKILL fallback).
  // The end is timed from the death (its "dying on purpose" line), not from the launch, as in
  // ADeadRankStopsTheJobNamingItAndLeavesNoProcess. The bound, 25 s: torchrun polls its ranks every 0.1 s
  // (--monitor-interval) and SIGKILLs a rank that ignores SIGTERM after 30 s; 25 s is below both that fallback
  // and the survivor's 120 s, and leaves a wide margin for a loaded machine: torchrun 2.11 took 0.6 s from a stand-in
  // rank's death to its own exit on an idle 2-core machine (2026-12-05).
  const auto torchrun = std::filesystem::path(MEMTRAIN_PYTHON).parent_path() / "torchrun";
  ASSERT_TRUE(std::filesystem::exists(torchrun)) << torchrun;
  constexpr int survivor_timeout_s = 120, bound_s = 25;
  struct Case {
    std::string env;
    int dead_rank;
    bool survivor_waits_at_store;
  };
  for (const Case& c : {Case{"PROBE_DIE_RANK=0", 0, false}, Case{"PROBE_DIE_RANK=1 PROBE_DIE_BEFORE_RENDEZVOUS=1", 1, true}}) {
    SCOPED_TRACE(c.env);
    test::TempDir dir;
    const auto log = dir.path("job.log");
    auto r = run(c.env + " PROBE_TIMEOUT_S=" + std::to_string(survivor_timeout_s) + " " + torchrun.string() +
                 " --no-python --standalone --nproc-per-node 2 " + probe() + " > " + log + " 2>&1 & L=$!; " +
                 test::wait_for_line(log, "dying on purpose", 120) + "; t0=$(date +%s.%N); " +
                 test::wait_at_most("$L", survivor_timeout_s + 30) + "; code=$?; t1=$(date +%s.%N); cat " + log +
                 "; echo \"exit=$code\"; echo \"t0=$t0 t1=$t1\"");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("exit=([0-9]+)"))) << r.output;
    EXPECT_EQ(std::stoi(m[1]), 1) << r.output;  // torchrun's ChildFailedError (137 would be our own SIGKILL)
    ASSERT_NE(r.output.find("dying on purpose"), std::string::npos) << r.output;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("t0=([0-9.]+) t1=([0-9.]+)"))) << r.output;
    const double after_death = std::stod(m[2]) - std::stod(m[1]);
    EXPECT_LT(after_death, bound_s) << "the job outlived its dead rank by " << after_death << " s:\n" << r.output;
    // torchrun names the first failure: the dead rank and its own exit code.
    EXPECT_NE(r.output.find("failed (exitcode: 3) local_rank: " + std::to_string(c.dead_rank) + " (pid:"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("collectives ok"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("Unable to shutdown process"), std::string::npos) << r.output;  // no SIGKILL fallback
    if (c.survivor_waits_at_store) {
      // The survivor was alive when torchrun acted, was sent SIGTERM and died of it (exit code -15), and did not
      // give up on its own (its rendezvous error names the timeout).
      EXPECT_NE(r.output.find("closing signal SIGTERM"), std::string::npos) << r.output;
      EXPECT_TRUE(std::regex_search(r.output, std::regex("rank\\s*:\\s*0 \\(local_rank: 0\\)\\s*exitcode\\s*:\\s*-15 ")))
          << r.output;
      EXPECT_EQ(r.output.find("rendezvous at"), std::string::npos) << r.output;
    }
  }
}

TEST(Rendezvous, AMissingRankFailsWithinTheTimeoutNamingTheStore) {
  // World of 2, only rank 0 started: the store waits for a rank that never comes.
  const auto port = std::to_string(test::free_port());
  auto r = run("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " PROBE_TIMEOUT_S=3 " + probe());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("rendezvous at 127.0.0.1:" + port + " failed: serving the store for 2 ranks within 3 s"),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 30);
  // A rank pointed at an address where nobody serves: it gives up within the timeout, too.
  r = run("RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(test::free_port()) +
          " PROBE_TIMEOUT_S=3 " + probe());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("joining the store of 2 ranks"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 30);
}

TEST(Rendezvous, ALoneRankSaysWhatItWaitsFor) {
  // World of 2, only rank 0, a timeout of 8 s: after 5 s it says where it waits and how many ranks joined, then
  // fails within the timeout naming the count.
  const auto port = std::to_string(test::free_port());
  auto r = run("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " PROBE_TIMEOUT_S=8 " + probe());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("[dist] rank 0: waiting at 127.0.0.1:" + port + " for the ranks to join: 1 of 2 so far ("),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("s of 8 s, dist.timeout_s)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("serving the store for 2 ranks within 8 s (dist.timeout_s): 1 of 2 ranks joined"), std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 30);
}

TEST(Rendezvous, ABusyPortIsNamed) {
  // Another process listens on the port rank 0 must serve the store on; the probe starts once it listens.
  test::TempDir dir;
  const auto port = std::to_string(test::free_port()), ready = dir.path("listening");
  auto r = run("python3 -c \"import socket,time; s=socket.socket(); s.bind(('127.0.0.1', " + port + ")); s.listen(); "
               "open('" + ready + "', 'w').write('yes'); time.sleep(60)\" & P=$!; " + test::wait_for_line(ready, "yes", 20) +
               "; (RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " PROBE_TIMEOUT_S=5 " + probe() +
               " 2>&1); code=$?; kill $P; wait $P; exit $code");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("rendezvous at 127.0.0.1:" + port + " failed: serving the store"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("that the port is free"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 30);
}

}  // namespace
}  // namespace memtrain
