// Construction from shapes (models/shapes.h, issue 36): a model whose parameters have their sizes, dtype and device
// but no memory. Expected counts are the model cards' (as transformers counts them) and the arithmetic below.
#include <gtest/gtest.h>

#include "helpers.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/models/gpt.h"
#include "memtrain/models/llama.h"

namespace memtrain {
namespace {

// Llama-3.1-70B (70,553,706,496 parameters, 282 GB in fp32) built on this CPU from shapes: under 1 MiB allocated
// (the counting allocator), every parameter with its size and bf16 dtype and no bytes, and the names and sizes a
// whole build of the same layout has (a small custom Llama, built both ways).
TEST(ShapesOnly, SeventyBillionParametersAllocateUnderOneMebibyte) {
  ASSERT_TRUE(cpu_memory::installed());
  auto o = LlamaOptions::preset("llama-3.1-70b");
  o.block_size = 8192;
  o.build = {.shapes_only = true, .dtype = torch::kBFloat16};
  const auto before = cpu_memory::current();
  cpu_memory::reset_peak();
  Llama model(o);
  EXPECT_LT(cpu_memory::peak() - before, 1 << 20);
  EXPECT_EQ(model.num_parameters(), 70553706496);
  int64_t elements = 0;
  for (const auto& p : model.parameters()) {
    EXPECT_TRUE(has_no_memory(p));
    EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(p.requires_grad());
    elements += p.numel();
  }
  EXPECT_EQ(elements, 70553706496);
  EXPECT_EQ(model.parameters().front().sizes(), (std::vector<int64_t>{128256, 8192}));  // the embedding

  LlamaOptions small;
  small.vocab_size = 97, small.n_embd = 32, small.ffn_hidden = 64, small.n_layer = 2, small.n_head = 4, small.n_kv_head = 2;
  small.qkv_bias = true, small.tie_embeddings = false;
  Llama whole(small);
  small.build.shapes_only = true;
  Llama shapes(small);
  const auto a = whole.named_parameters(), b = shapes.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].key(), b[i].key());
    EXPECT_EQ(a[i].value().sizes(), b[i].value().sizes()) << a[i].key();
    EXPECT_FALSE(has_no_memory(a[i].value())) << a[i].key();
  }
}

// GPT-2 XL (1,557,611,200 parameters: 48 blocks of 12 C^2 + 13 C at C = 1600, embeddings 50257 C + 1024 C, final
// LayerNorm 2 C) likewise, and its tied head stays one tensor.
TEST(ShapesOnly, GptXlHasItsCountAndNoMemory) {
  auto o = GPTOptions::preset("gpt2-xl");
  o.build.shapes_only = true;
  const auto before = cpu_memory::current();
  cpu_memory::reset_peak();
  GPT model(o);
  EXPECT_LT(cpu_memory::peak() - before, 1 << 20);
  const int64_t C = 1600;
  EXPECT_EQ(model.num_parameters(), 48 * (12 * C * C + 13 * C) + (50257 + 1024) * C + 2 * C);
  for (const auto& p : model.parameters()) EXPECT_TRUE(has_no_memory(p));
  EXPECT_EQ(model.wte->weight.dtype(), torch::kFloat);
}

}  // namespace
}  // namespace memtrain
