// memtrain: train a model from a config file.
//
//   memtrain [--config examples/configs/gpt_austen_cpu.ini] [--section.key=value ...]
//   memtrain --help                      every key, its default and what it does
//   memtrain --config X --print-config   the resolved config, without training
//   memtrain --print-config-reference    the Markdown page docs/config-reference.md
//
// Launched once per device, torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK, ... from the environment).
#include <signal.h>

#include <iostream>
#include <string>
#include <vector>

#include "memtrain/core/config.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/error.h"
#include "memtrain/distributed/world.h"
#include "memtrain/runtime/trainer.h"

namespace {
constexpr const char* kUsage =
    "usage: memtrain [--config FILE.ini] [--section.key=value ...] [--print-config] [--print-config-reference]\n"
    "Trains the model the config describes; without --config, the defaults below (a small byte-level GPT on\n"
    "the prepared Jane Austen text, on the CPU). A key given twice: the last value wins.\n";
}  // namespace

int main(int argc, char** argv) {
  // Before any tensor exists: every CPU allocation from here on is counted.
  memtrain::cpu_memory::install();
  memtrain::cpu_memory::keep_freed_memory();
  // A file-size limit (RLIMIT_FSIZE) or a full quota makes a write fail with EFBIG: an error that names
  // the file and keeps the last checkpoint, not a signal that kills the run part way through a save.
  signal(SIGXFSZ, SIG_IGN);
  std::string config_path;
  std::vector<std::string> overrides;
  bool print_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << kUsage << "\nkeys:\n" << memtrain::Config::help();
      return 0;
    }
    if (a == "--print-config-reference") {
      std::cout << memtrain::Config::reference_markdown();
      return 0;
    }
    if (a == "--print-config") {
      print_only = true;
    } else if (a == "--config" && i + 1 < argc) {
      config_path = argv[++i];
    } else if (a.rfind("--config=", 0) == 0) {
      config_path = a.substr(9);
    } else {
      overrides.push_back(a);
    }
  }
  try {
    auto config = memtrain::Config::load(config_path, overrides);
    if (memtrain::World::from_env().is_main())
      for (const auto& w : config.warnings) std::cerr << "memtrain: warning: " << w << "\n";
    if (print_only) {
      std::cout << config.to_ini();
      return 0;
    }
    memtrain::Trainer trainer(config);
    trainer.fit();
    return 0;
  } catch (const memtrain::Error& e) {
    std::cerr << "memtrain: " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "memtrain: LibTorch error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "memtrain: " << e.what() << "\n";
    return 1;
  }
}
