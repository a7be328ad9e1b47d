// memtrain-run: starts the processes of a multi-process run, in the spirit of torchrun.
//
//   memtrain-run --nproc-per-node 4 [--nnodes 2 --node-rank 0 --master-addr HOST --master-port PORT]
//                [--standalone] [--log-dir DIR] -- memtrain --config X.ini [...]
//
// Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT
// (and OMP_NUM_THREADS=1 when several share a node and it is unset, as torchrun does). Their output
// lines are prefixed with their rank (or written to DIR/rank<N>.log). SIGINT and SIGTERM are forwarded
// (each time; SIGHUP as SIGTERM) to each rank's process group.
// When one child fails, the others are stopped (SIGTERM, then SIGKILL after a grace period) and the
// launcher exits with that child's code and a line naming its rank. No LibTorch here: it only starts
// processes.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr const char* kUsage =
    "usage: memtrain-run --nproc-per-node N [--nnodes M --node-rank K] [--master-addr A] [--master-port P]\n"
    "                    [--standalone] [--log-dir DIR] [--grace-s S] [--stop-grace-s S] -- COMMAND [ARGS...]\n"
    "  --master-port 0 (or --standalone on one node) picks a free port.\n"
    "  --grace-s S: after a rank fails, the others get S seconds (10) to exit before SIGKILL.\n"
    "  --stop-grace-s S: after a SIGTERM / SIGINT to the launcher (forwarded), the ranks get S seconds (120) to\n"
    "    finish their step and save before SIGKILL, so that a job stuck in a collective still ends.\n";

struct Options {
  int nproc = 1, nnodes = 1, node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  std::string log_dir;
  int grace_s = 10;  // after a rank failed: time for the others to exit before SIGKILL
  int stop_grace_s = 120;  // after a forwarded SIGTERM / SIGINT: time to finish the step and save before SIGKILL
  std::vector<std::string> command;
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::cerr << "memtrain-run: " << msg << "\n" << kUsage;
  std::exit(2);
}

int parse_int(const std::string& flag, const std::string& v, int min) {
  try {
    size_t used = 0;
    int x = std::stoi(v, &used);
    if (used == v.size() && x >= min) return x;
  } catch (...) {
  }
  usage_error(flag + " = '" + v + "': expected an integer >= " + std::to_string(min));
}

Options parse(int argc, char** argv) {
  Options o;
  int i = 1;
  auto value = [&](const std::string& flag) -> std::string {
    std::string a = argv[i];
    if (auto eq = a.find('='); eq != std::string::npos) return a.substr(eq + 1);
    if (i + 1 >= argc) usage_error(flag + " needs a value");
    return argv[++i];
  };
  for (; i < argc; ++i) {
    std::string a = argv[i];
    auto is = [&](const char* flag) { return a == flag || a.rfind(std::string(flag) + "=", 0) == 0; };
    if (a == "--") {
      for (++i; i < argc; ++i) o.command.push_back(argv[i]);
      break;
    } else if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (is("--nproc-per-node") || is("--nproc_per_node")) {
      o.nproc = parse_int("--nproc-per-node", value("--nproc-per-node"), 1);
    } else if (is("--nnodes")) {
      o.nnodes = parse_int("--nnodes", value("--nnodes"), 1);
    } else if (is("--node-rank") || is("--node_rank")) {
      o.node_rank = parse_int("--node-rank", value("--node-rank"), 0);
    } else if (is("--master-addr") || is("--master_addr")) {
      o.master_addr = value("--master-addr");
    } else if (is("--master-port") || is("--master_port")) {
      o.master_port = parse_int("--master-port", value("--master-port"), 0);
    } else if (a == "--standalone") {
      o.standalone = true;
    } else if (is("--log-dir")) {
      o.log_dir = value("--log-dir");
    } else if (is("--grace-s")) {
      o.grace_s = parse_int("--grace-s", value("--grace-s"), 0);
    } else if (is("--stop-grace-s")) {
      o.stop_grace_s = parse_int("--stop-grace-s", value("--stop-grace-s"), 0);
    } else if (a.rfind("--", 0) == 0) {
      usage_error("unknown option '" + a + "'");
    } else {  // the command starts here (no "--")
      for (; i < argc; ++i) o.command.push_back(argv[i]);
      break;
    }
  }
  if (o.command.empty()) usage_error("no command to run");
  if (o.node_rank >= o.nnodes) usage_error("--node-rank " + std::to_string(o.node_rank) + " is not below --nnodes");
  if (o.standalone) {
    if (o.nnodes != 1) usage_error("--standalone is for one node; with --nnodes give --master-addr and --master-port");
    o.master_addr = "127.0.0.1";
    o.master_port = 0;
  }
  if (o.master_port == 0 && o.nnodes > 1)
    usage_error("--master-port 0 picks a free port on this node only; with --nnodes > 1 every node needs the same port");
  return o;
}

// A free TCP port on addr (bound, read back, closed: another process could take it in between, as with
// torchrun's --standalone).
int free_port(const std::string& addr) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  inet_pton(AF_INET, addr.c_str(), &sa.sin_addr);
  socklen_t len = sizeof sa;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    std::cerr << "memtrain-run: cannot find a free port on " << addr << ": " << std::strerror(errno) << "\n";
    std::exit(1);
  }
  close(fd);
  return ntohs(sa.sin_port);
}

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

// Children are reaped in the SIGCHLD handler, in the order they exit: when one rank dies and its peers
// fail a moment later in their collectives, the launcher names the first, not whichever it polls first.
constexpr int kMaxChildren = 4096;
pid_t g_exited_pid[kMaxChildren];
int g_exited_status[kMaxChildren];
volatile sig_atomic_t g_exited = 0;
void on_child(int) {
  const int saved = errno;
  int status = 0;
  pid_t pid;
  while (g_exited < kMaxChildren && (pid = waitpid(-1, &status, WNOHANG)) > 0) {
    g_exited_pid[g_exited] = pid;
    g_exited_status[g_exited] = status;
    g_exited = g_exited + 1;
  }
  errno = saved;
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;       // read end of the child's stdout+stderr
  std::string partial;   // an unfinished output line
  std::ofstream log;     // --log-dir: the rank's log file
  bool running = true;
  int status = 0;
};

void emit(Child& c, const std::string& line) {
  if (c.log.is_open()) {
    c.log << line << "\n" << std::flush;
  } else {
    std::string out = "[rank " + std::to_string(c.rank) + "] " + line + "\n";
    (void)!write(STDOUT_FILENO, out.data(), out.size());
  }
}

void drain(Child& c) {
  char buf[4096];
  ssize_t n;
  while ((n = read(c.out_fd, buf, sizeof buf)) > 0) {
    c.partial.append(buf, static_cast<size_t>(n));
    for (size_t nl; (nl = c.partial.find('\n')) != std::string::npos;) {
      emit(c, c.partial.substr(0, nl));
      c.partial.erase(0, nl + 1);
    }
  }
  if (n == 0) {  // the child closed its output (it may still run): stop polling it, or poll spins on POLLHUP
    if (!c.partial.empty()) emit(c, c.partial), c.partial.clear();
    close(c.out_fd);
    c.out_fd = -1;
  }
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "exited with code " + std::to_string(exit_code(status));
}

void install_signal_handlers() {
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);  // the terminal went away: stop the ranks too
  signal(SIGPIPE, SIG_IGN);
  struct sigaction sc{};
  sc.sa_handler = on_child;
  sc.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sigaction(SIGCHLD, &sc, nullptr);
}

// The child of fork(), as rank `rank` (`local` on this node): its own process group, output into the pipe,
// the environment of torchrun, then the command. Never returns. `o` is not const: execvp takes char*.
[[noreturn]] void exec_rank(Options& o, int world, int local, int rank, const int fds[2], pid_t launcher_pid) {
  // Its own process group: a Ctrl-C on the terminal reaches the launcher only, which forwards each
  // signal once to each rank (so a second Ctrl-C is a rank's second signal, not its third). Signals go
  // to the whole group, so a wrapper command (sh -c, numactl) and the rank under it stop together.
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGTERM);  // the launcher died: do not train on unsupervised
  if (getppid() != launcher_pid) _exit(1);
  signal(SIGPIPE, SIG_DFL);
  dup2(fds[1], STDOUT_FILENO);
  dup2(fds[1], STDERR_FILENO);
  close(fds[0]);
  close(fds[1]);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
  setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
  setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
  setenv("MASTER_PORT", std::to_string(o.master_port).c_str(), 1);
  if (o.nproc > 1) setenv("OMP_NUM_THREADS", "1", 0);  // as torchrun: N processes share the cores
  std::vector<char*> args;
  for (auto& a : o.command) args.push_back(a.data());
  args.push_back(nullptr);
  execvp(args[0], args.data());
  std::fprintf(stderr, "memtrain-run: cannot run '%s': %s\n", args[0], std::strerror(errno));
  _exit(127);
}

// Forks and execs one child per local rank; 0, or the launcher's exit code when one could not be started.
int start_ranks(Options& o, int world, std::vector<Child>& children) {
  // Starting failed part way: stop and reap the ranks already started, never signal pid <= 0.
  auto abandon = [&](const char* what) {
    std::perror(what);
    for (auto& c : children)
      if (c.pid > 0) kill(-c.pid, SIGKILL);
    for (auto& c : children)
      if (c.pid > 0) waitpid(c.pid, nullptr, 0);
    return 1;
  };
  const pid_t launcher_pid = getpid();
  for (int local = 0; local < o.nproc; ++local) {
    auto& c = children[static_cast<size_t>(local)];
    c.rank = o.node_rank * o.nproc + local;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return abandon("memtrain-run: pipe");  // no rank inherits another's pipe
    c.pid = fork();
    if (c.pid < 0) {
      c.pid = -1;
      close(fds[0]);
      close(fds[1]);
      return abandon("memtrain-run: fork");
    }
    if (c.pid == 0) exec_rank(o, world, local, c.rank, fds, launcher_pid);  // never returns
    setpgid(c.pid, c.pid);  // also here: no race with the child's own call before the first kill
    close(fds[1]);
    fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    c.out_fd = fds[0];
  }
  return 0;
}

// Log files after every fork, so that no rank inherits them.
void open_log_files(const Options& o, std::vector<Child>& children) {
  for (auto& c : children) {
    if (o.log_dir.empty()) continue;
    c.log.open(o.log_dir + "/rank" + std::to_string(c.rank) + ".log");
    if (!c.log.good()) std::cerr << "memtrain-run: cannot write " << o.log_dir << "/rank" << c.rank << ".log\n";
  }
}

// What the launcher knows while the ranks run.
struct Supervision {
  int result = 0;
  int handled = 0;  // entries of g_exited_* already processed
  bool stopping = false;
  std::chrono::steady_clock::time_point stop_time = std::chrono::steady_clock::time_point::max();
  int forwarded = 0;
};

// Signals each rank's process group that still runs. `handled`: entries of g_exited_* already processed.
void stop_all(const std::vector<Child>& children, int handled, int sig) {
  for (auto& c : children) {
    if (!c.running || c.pid <= 0) continue;
    // Reaped by the SIGCHLD handler but not yet processed: its pid may already be someone else's.
    bool reaped = false;
    for (int i = handled; i < g_exited; ++i) reaped = reaped || g_exited_pid[i] == c.pid;
    if (!reaped) kill(-c.pid, sig);
  }
}

// Output first, so that a failing rank's last words come before the launcher's verdict.
void relay_output(std::vector<Child>& children) {
  std::vector<pollfd> fds;
  for (auto& c : children)
    if (c.out_fd >= 0) fds.push_back({c.out_fd, POLLIN, 0});
  if (!fds.empty()) poll(fds.data(), fds.size(), 100);
  else std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (auto& c : children)
    if (c.out_fd >= 0) drain(c);
}

// A signal to the launcher: forward it; the children save and exit (a second one: they exit at once).
void forward_signal(const Options& o, const std::vector<Child>& children, Supervision& s) {
  const int sig = g_signal;
  g_signal = 0;
  std::cerr << "memtrain-run: " << strsignal(sig) << ": forwarding to the ranks (SIGKILL to those still running in "
            << o.stop_grace_s << " s, --stop-grace-s)\n";
  // The ranks finish a step and save a checkpoint, which takes its time: --stop-grace-s (120 s) is for that.
  // Ranks stuck in a collective (a peer stopped or gone) would never get there: they are killed after it,
  // as torchrun does. A second signal is forwarded too and makes them exit at once.
  stop_all(children, s.handled, sig == SIGHUP ? SIGTERM : sig);
  if (s.forwarded++ == 0)
    s.stop_time = std::min(s.stop_time, std::chrono::steady_clock::now() + std::chrono::seconds(o.stop_grace_s));
}

// The ranks reaped since the last call, in exit order: the first to fail sets the result and stops the others.
void process_exits(const Options& o, std::vector<Child>& children, Supervision& s) {
  for (; s.handled < g_exited; ++s.handled) {  // in exit order
    for (auto& c : children) {
      if (!c.running || c.pid != g_exited_pid[s.handled]) continue;
      const int status = g_exited_status[s.handled];
      c.running = false;
      c.status = status;
      if (c.out_fd >= 0) {
        drain(c);
        if (!c.partial.empty()) emit(c, c.partial), c.partial.clear();
        if (c.out_fd >= 0) close(c.out_fd);
        c.out_fd = -1;
      }
      if (exit_code(status) != 0 && s.result == 0) s.result = exit_code(status);
      if (exit_code(status) != 0 && !s.stopping) {
        std::cerr << "memtrain-run: rank " << c.rank << " (pid " << c.pid << ") " << describe(status)
                  << "; stopping the other ranks\n";
        s.stopping = true;
        stop_all(children, s.handled, SIGTERM);
        s.stop_time = std::min(s.stop_time, std::chrono::steady_clock::now() + std::chrono::seconds(o.grace_s));
      }
    }
  }
}

// Relays output, forwards signals and reaps the ranks until none runs; SIGKILL for those left past the grace.
Supervision supervise(const Options& o, std::vector<Child>& children) {
  Supervision s;
  for (;;) {
    relay_output(children);

    if (g_signal != 0) forward_signal(o, children, s);
    process_exits(o, children, s);
    bool any_running = false;
    for (const auto& c : children) any_running = any_running || c.running;
    if (!any_running) break;
    if ((s.stopping || s.forwarded > 0) && std::chrono::steady_clock::now() > s.stop_time) {
      std::cerr << "memtrain-run: ranks still running " << (s.stopping ? o.grace_s : o.stop_grace_s)
                << " s after the stop: killing them\n";
      stop_all(children, s.handled, SIGKILL);
      s.stop_time = std::chrono::steady_clock::time_point::max();
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  auto o = parse(argc, argv);
  if (o.master_port == 0) o.master_port = free_port(o.master_addr);
  const int world = o.nnodes * o.nproc;
  if (!o.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.log_dir, ec);
    if (ec) {
      std::cerr << "memtrain-run: cannot create --log-dir '" << o.log_dir << "': " << ec.message() << "\n";
      return 1;
    }
  }

  install_signal_handlers();
  if (o.nproc > kMaxChildren) usage_error("--nproc-per-node above " + std::to_string(kMaxChildren));

  std::vector<Child> children(static_cast<size_t>(o.nproc));
  if (const int failed = start_ranks(o, world, children); failed != 0) return failed;
  open_log_files(o, children);

  const auto s = supervise(o, children);
  if (s.result != 0 && s.forwarded == 0) {
    std::cerr << "memtrain-run: failed with exit code " << s.result << " (";
    for (size_t i = 0; i < children.size(); ++i)
      std::cerr << (i ? ", " : "") << "rank " << children[i].rank << ": " << exit_code(children[i].status);
    std::cerr << ")\n";
  }
  return s.result;
}
