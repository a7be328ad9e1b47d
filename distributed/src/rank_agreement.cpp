#include "memtrain/distributed/rank_agreement.h"

#include "memtrain/distributed/data_parallel.h"

namespace memtrain {

namespace {
torch::Tensor doubles(const std::vector<double>& v, const c10::Device& device) {
  return torch::tensor(v, torch::TensorOptions().dtype(torch::kDouble)).to(device);
}
}  // namespace

int RankAgreement::world() const { return dp_ ? dp_->world_size() : 1; }

bool RankAgreement::all(bool ok) const { return sum(ok ? 0.0 : 1.0) == 0; }

bool RankAgreement::any(bool flag) const { return sum(flag ? 1.0 : 0.0) != 0; }

double RankAgreement::sum(double value) const { return sum(std::vector<double>{value}).front(); }

std::vector<double> RankAgreement::sum(std::vector<double> values) const {
  if (!dp_) return values;
  auto t = doubles(values, device_);
  dp_->group_all_reduce_sum(t);
  auto host = t.cpu();
  for (size_t i = 0; i < values.size(); ++i) values[i] = host[static_cast<int64_t>(i)].item<double>();
  return values;
}

double RankAgreement::mean(double value) const { return sum(value) / world(); }

double RankAgreement::max(double value) const {
  if (!dp_) return value;
  auto t = doubles({value}, device_);
  dp_->group_all_reduce_max(t);
  return t.item<double>();
}

double RankAgreement::min(double value) const { return -max(-value); }

torch::Tensor RankAgreement::gather_rows(const torch::Tensor& rows) const {
  auto mine = rows.to(torch::kLong).contiguous();
  if (!dp_) return mine.unsqueeze(0);
  auto input = mine.flatten().to(device_);
  auto all = torch::empty({world() * input.numel()}, input.options());
  dp_->group_all_gather(all, input);
  auto shape = mine.sizes().vec();
  shape.insert(shape.begin(), world());
  return all.cpu().view(shape);
}

}  // namespace memtrain
