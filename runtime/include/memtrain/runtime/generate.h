// Text from a trained language model: continues a prompt of token ids one sampled token at a time.
//
//   auto ids = memtrain::generate(*model, /*block_size=*/128, prompt, {.tokens = 200, .temperature = 0.8});
#pragma once

#include <cstdint>
#include <vector>

#include "memtrain/models/model.h"

namespace memtrain {

struct GenerateOptions {
  int64_t tokens = 200;      // new tokens
  double temperature = 0.8;  // > 0; lower is more conservative
  int64_t top_k = 50;        // sample among the k most likely (0 = all)
  uint64_t seed = 1337;
};

// The prompt's continuation (new ids only). The model's forward maps (1, T) ids to (1, T, vocab) logits
// (a GPT); the context is cropped to its last block_size tokens. Runs in eval mode without gradients.
std::vector<int64_t> generate(Model& model, int64_t block_size, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options);

}  // namespace memtrain
