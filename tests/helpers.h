// Shared test helpers: configs for small runs, fixture access, tensor comparison.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "memtrain/core/config.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/models/gpt.h"
#include "test_paths.h"

namespace memtrain::test {

inline std::string fixture(const std::string& name) { return std::string(MEMTRAIN_FIXTURES) + "/" + name; }
inline std::string source(const std::string& rel) { return std::string(MEMTRAIN_SOURCE_DIR) + "/" + rel; }

// The small GPT of scripts/reference/make_fixtures.py (vocab 64, context 16, 2 layers, 2 heads, width 32)
// with PyTorch's weights from gpt_parity.safetensors, which also holds the batch ("input", "target")
// and PyTorch's logits, loss and gradients for it.
inline std::shared_ptr<GPT> fixture_gpt(double dropout = 0.0) {
  auto ref = load_safetensors(fixture("gpt_parity.safetensors"));
  GPTOptions o;
  o.vocab_size = 64, o.block_size = 16, o.n_layer = 2, o.n_head = 2, o.n_embd = 32, o.dropout = dropout;
  auto gpt = std::make_shared<GPT>(o);
  std::map<std::string, torch::Tensor> weights;
  for (const auto& item : gpt->named_parameters()) weights[item.key()] = ref.at(item.key());
  load_module_state(*gpt, weights, "gpt_parity.safetensors");
  return gpt;
}

// The folder of this test process's run folders (log.dir): its own, so two suites on one host never write
// into each other's runs; tests/main.cpp removes it at the end.
inline std::string run_root() {
  return (std::filesystem::temp_directory_path() / ("memtrain-tests-" + std::to_string(::getpid()))).string();
}

// A small byte-level GPT on synthetic tokens: fast, no data files.
inline Config tiny_gpt_config(int64_t layers = 2) {
  Config c;
  c.model.name = "gpt";
  c.model.n_layer = layers;
  c.model.n_head = 2;
  c.model.n_embd = 32;
  c.model.block_size = 32;
  c.data.dataset = "synthetic";
  c.train.steps = 10;
  c.train.micro_batch = 4;
  c.train.warmup_steps = 2;
  c.train.eval_every = 0;
  c.log.dir = run_root();
  c.log.overwrite = true;  // tests rerun in the same folders
  return c;
}

// A file under a fresh temporary folder, removed with the object.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("memtrain-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name, const std::string& contents) const {
    auto p = (path_ / name).string();
    std::ofstream(p) << contents;
    return p;
  }
  std::string path(const std::string& name = "") const { return (path_ / name).string(); }

 private:
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::filesystem::path path_;
};

// A binary of this build tree, e.g. binary("memtrain-run").
inline std::string binary(const std::string& name) {
  return (std::filesystem::path(MEMTRAIN_BINARY_DIR) / name).string();
}

// Runs a shell command and returns what it printed on stdout (add 2>&1 for stderr); its exit code goes
// to *code. Multi-process tests start launchers this way.
inline std::string shell(const std::string& command, int* code = nullptr) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  std::array<char, 4096> buf;
  while (p && fgets(buf.data(), buf.size(), p)) out += buf.data();
  const int status = p ? pclose(p) : -1;
  if (code) *code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

// A TCP port on 127.0.0.1 that nothing listens on now: `port` itself (0: one chosen by the OS), or -1 when it is
// taken. For tests that start a store or a listener of their own: two suites on one host never share a fixed port.
inline int bindable_port(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof a;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  if (fd >= 0) ::close(fd);
  return ok ? ntohs(a.sin_port) : -1;
}

inline int free_port() {
  const int port = bindable_port(0);
  if (port < 0) throw std::runtime_error("free_port: cannot bind a socket on 127.0.0.1");
  return port;
}

// A free port in [lo, hi), tried from a point that depends on the process (two suites start apart).
inline int free_port_between(int lo, int hi) {
  for (int i = 0; i < hi - lo; ++i)
    if (const int p = bindable_port(lo + (::getpid() * 7919 + i) % (hi - lo)); p > 0) return p;
  throw std::runtime_error("free_port_between: every port is taken");
}

// A shell fragment for tests that signal a process they started in the background: waits (at most
// `seconds`) until `file` has a line matching the grep pattern `line`, e.g. wait_for_line(log, "^run folder:").
inline std::string wait_for_line(const std::string& file, const std::string& line, int seconds) {
  return "for i in $(seq " + std::to_string(seconds * 20) + "); do grep -q '" + line + "' " + file +
         " && break; sleep 0.05; done";
}

// A shell fragment: waits for the background process `pid` (a shell expression, e.g. "$L") at most `seconds`,
// then SIGKILLs it if it still runs, and reaps it; $? is its exit status (137 if it had to be killed). A
// launcher killed so takes its ranks with it (they die with their parent): a test that fails leaves nothing.
inline std::string wait_at_most(const std::string& pid, int seconds) {
  return "timeout " + std::to_string(seconds) + " tail --pid=" + pid + " -s 0.1 -f /dev/null; kill -9 " + pid +
         " 2>/dev/null; wait " + pid;
}

// The number `key` of each line of a run's metrics.jsonl that has it, in order (a resumed run's lines appended).
inline std::vector<double> metric_values(const std::string& metrics_jsonl, const std::string& key) {
  std::vector<double> out;
  std::ifstream in(metrics_jsonl);
  std::smatch m;
  const std::regex number("\"" + key + "\":([^,}]+)");
  for (std::string line; std::getline(in, line);)
    if (std::regex_search(line, m, number)) out.push_back(std::stod(m[1]));
  return out;
}

// Each line's "loss".
inline std::vector<double> metric_losses(const std::string& metrics_jsonl) { return metric_values(metrics_jsonl, "loss"); }

// Each line's "grad_norm": the global gradient norm before clipping. A reduction that sums where it should average
// leaves AdamW's losses alone (its update and clipping are blind to a common scale of the gradients) but multiplies
// this norm by the world size.
inline std::vector<double> metric_grad_norms(const std::string& metrics_jsonl) {
  return metric_values(metrics_jsonl, "grad_norm");
}

// max |a - b| / (max |b| + tiny): a scale-free distance for comparing gradients.
inline double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  auto fa = a.to(torch::kDouble), fb = b.to(torch::kDouble);
  return (fa - fb).abs().max().item<double>() / (fb.abs().max().item<double>() + 1e-12);
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

}  // namespace memtrain::test
