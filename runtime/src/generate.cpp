#include "memtrain/runtime/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include "memtrain/core/error.h"

namespace memtrain {

std::vector<int64_t> generate(Model& model, int64_t block_size, const std::vector<int64_t>& prompt,
                              const GenerateOptions& o) {
  MEMTRAIN_CHECK(!prompt.empty(), Error, "[generate] the prompt needs at least one token");
  MEMTRAIN_CHECK(o.temperature > 0, Error, "[generate] temperature must be > 0, got ", o.temperature);
  torch::NoGradGuard no_grad;
  model.eval();
  const auto device = model.parameters().front().device();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<int64_t> ids = prompt, out;
  for (int64_t i = 0; i < o.tokens; ++i) {
    const auto from = static_cast<int64_t>(ids.size()) > block_size ? ids.size() - block_size : 0;
    auto context = torch::tensor(std::vector<int64_t>(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.end()),
                                 torch::kLong)
                       .unsqueeze(0)
                       .to(device);
    auto logits = model.forward(context).select(1, -1).squeeze(0).to(torch::kFloat).cpu() / o.temperature;  // (vocab,)
    if (o.top_k > 0 && o.top_k < logits.size(0)) {
      auto kth = std::get<0>(logits.topk(o.top_k)).min();
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    const auto next = torch::multinomial(logits.softmax(0), 1, false, gen).item<int64_t>();
    ids.push_back(next);
    out.push_back(next);
  }
  model.train();
  return out;
}

}  // namespace memtrain
