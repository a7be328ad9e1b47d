// SIGTERM / SIGINT during Trainer::fit() (stop_signals.h).
#include "stop_signals.h"

#include <unistd.h>

#include <csignal>

namespace memtrain::detail {

namespace {
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal != 0) _exit(128 + sig);  // the second one: at once
  g_stop_signal = sig;
  static const char msg[] = "memtrain: stop requested: finishing this step and saving a checkpoint (again: exit now)\n";
  [[maybe_unused]] auto n = ::write(STDERR_FILENO, msg, sizeof msg - 1);
}
}  // namespace

StopSignals::StopSignals() {
  g_stop_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;  // a write to a pipe interrupted by the signal goes on (std::cout stays good)
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, &old_term_);
  sigaction(SIGINT, &sa, &old_int_);
}

StopSignals::~StopSignals() {
  sigaction(SIGTERM, &old_term_, nullptr);
  sigaction(SIGINT, &old_int_, nullptr);
}

int StopSignals::received() { return g_stop_signal; }

}  // namespace memtrain::detail
