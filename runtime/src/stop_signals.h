// SIGTERM / SIGINT during Trainer::fit(): the first asks for a stop after the current step (with a
// checkpoint), the second exits at once. Internal to the runtime.
#pragma once

#include <signal.h>

namespace memtrain::detail {

// Installs the handlers for its lifetime and clears any earlier request; the previous handlers return
// when it is destroyed.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  static int received();  // the signal that asked for a stop; 0 if none

 private:
  struct sigaction old_term_ {}, old_int_ {};
};

}  // namespace memtrain::detail
