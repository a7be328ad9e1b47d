// Test entry point: installs the counting CPU allocator before any tensor exists, as the binary does, and
// removes this process's run folders (test::run_root()) at the end.
#include <gtest/gtest.h>

#include <filesystem>

#include "helpers.h"
#include "memtrain/core/cpu_memory.h"

namespace {
class RemoveRunRoot : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(memtrain::test::run_root(), ignored);
  }
};
}  // namespace

int main(int argc, char** argv) {
  memtrain::cpu_memory::install();
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new RemoveRunRoot);
  return RUN_ALL_TESTS();
}
