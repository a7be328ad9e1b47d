// Which blocks activation checkpointing recomputes: the grammar of memory.recompute and its parsed form.
// A plain value type at the bottom layer, so the config validator and the runtime read one grammar.
//
//   auto policy = memtrain::RecomputePolicy::parse("every:2");   // blocks 0, 2, 4, ...
//   policy.checkpoints_block(3);                                   // false
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memtrain {

struct RecomputePolicy {
  enum class Mode { kNone, kAll, kEvery, kPart, kBudget };
  Mode mode = Mode::kNone;
  int64_t every = 1;          // kEvery: blocks 0, k, 2k, ...
  std::string part;           // kPart: the block part to recompute ("attn" | "mlp")
  double budget_mib = 0;      // kBudget: activation budget
  std::vector<bool> blocks;   // kBudget, once resolved: which blocks to checkpoint
  bool offload = false;

  // none | all | every:K | attn | mlp | budget:MiB
  static RecomputePolicy parse(const std::string& text);
  std::string describe() const;
  // Whether part `part_name` of block i is checkpointed (whole-block modes answer for part "").
  bool checkpoints_block(int64_t i) const;
  bool checkpoints_part(const std::string& part_name) const { return mode == Mode::kPart && part == part_name; }
  bool budget_unresolved() const { return mode == Mode::kBudget && blocks.empty(); }
};

}  // namespace memtrain
