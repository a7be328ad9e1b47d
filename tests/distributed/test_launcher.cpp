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
  const std::string common = " --nnodes 2 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29731 -- " + probe();
  // Node 1 in the background; whatever node 0 does, node 1 is stopped and waited for before the test ends.
  auto r = run(launcher() + " --node-rank 1" + common + " > /tmp/memtrain-node1.log 2>&1 & N1=$!; " + launcher() +
               " --node-rank 0" + common + "; c=$?; sleep 1; kill $N1 2>/dev/null; wait $N1; cat /tmp/memtrain-node1.log; "
               "exit $c");
  EXPECT_EQ(r.code, 0) << r.output;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(r.output.find("collectives ok: rank " + std::to_string(rank) + " of 4"), std::string::npos) << r.output;
}

TEST(Launcher, TorchrunStartsTheSameRanks) {
  const auto torchrun = std::filesystem::path(MEMTRAIN_PYTHON).parent_path() / "torchrun";
  ASSERT_TRUE(std::filesystem::exists(torchrun)) << torchrun;
  auto r = run(torchrun.string() + " --no-python --standalone --nproc-per-node 2 " + probe());
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("collectives ok: rank 1 of 2"), std::string::npos) << r.output;
}

TEST(Launcher, ADeadRankStopsTheJobNamingItAndLeavesNoProcess) {
  auto r = run("PROBE_DIE_RANK=1 PROBE_PRINT_PID=1 PROBE_TIMEOUT_S=20 " + launcher() +
               " --standalone --nproc-per-node 3 --grace-s 3 -- " + probe());
  EXPECT_EQ(r.code, 3) << r.output;  // the dead rank's own exit code
  EXPECT_NE(r.output.find("memtrain-run: rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 3; stopping the other ranks"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 15) << "the job did not stop promptly";
  std::smatch m;
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
  const auto torchrun = std::filesystem::path(MEMTRAIN_PYTHON).parent_path() / "torchrun";
  auto r = run("PROBE_DIE_RANK=0 PROBE_TIMEOUT_S=20 " + torchrun.string() +
               " --no-python --standalone --nproc-per-node 2 " + probe());
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_LT(r.seconds, 60);
}

TEST(Rendezvous, AMissingRankFailsWithinTheTimeoutNamingTheStore) {
  // World of 2, only rank 0 started: the store waits for a rank that never comes.
  auto r = run("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29732 PROBE_TIMEOUT_S=3 " + probe());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("rendezvous at 127.0.0.1:29732 failed: serving the store for 2 ranks within 3 s"),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 30);
  // A rank pointed at an address where nobody serves: it gives up within the timeout, too.
  r = run("RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29733 PROBE_TIMEOUT_S=3 " + probe());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("joining the store of 2 ranks"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 30);
}

TEST(Rendezvous, ABusyPortIsNamed) {
  // Another process listens on the port rank 0 must serve the store on.
  auto r = run("python3 -c \"import socket,time; s=socket.socket(); s.bind(('127.0.0.1', 29734)); s.listen(); "
               "time.sleep(15)\" & P=$!; sleep 1; (RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29734 "
               "PROBE_TIMEOUT_S=5 " + probe() + " 2>&1); code=$?; kill $P; exit $code");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("rendezvous at 127.0.0.1:29734 failed: serving the store"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("that the port is free"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 30);
}

}  // namespace
}  // namespace memtrain
