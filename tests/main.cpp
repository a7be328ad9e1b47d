// Test entry point: installs the counting CPU allocator before any tensor exists, as the binary does.
#include <gtest/gtest.h>

#include "memtrain/core/cpu_memory.h"

int main(int argc, char** argv) {
  memtrain::cpu_memory::install();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
