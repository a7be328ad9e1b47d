#include "memtrain/distributed/rank_agreement.h"

#include "memtrain/distributed/data_parallel.h"
#include "memtrain/distributed/process_group.h"

namespace memtrain {

namespace {
torch::Tensor doubles(const std::vector<double>& v, const c10::Device& device) {
  return torch::tensor(v, torch::TensorOptions().dtype(torch::kDouble)).to(device);
}
}  // namespace

int RankAgreement::world() const { return dp_ ? dp_->world_size() : group_ ? group_->size() : 1; }

void RankAgreement::all_reduce(torch::Tensor& t, bool max) const {
  if (dp_) max ? dp_->group_all_reduce_max(t) : dp_->group_all_reduce_sum(t);
  else max ? group_->all_reduce_max(t) : group_->all_reduce_sum(t);
}

bool RankAgreement::all(bool ok) const { return sum(ok ? 0.0 : 1.0) == 0; }

bool RankAgreement::any(bool flag) const { return sum(flag ? 1.0 : 0.0) != 0; }

double RankAgreement::sum(double value) const { return sum(std::vector<double>{value}).front(); }

std::vector<double> RankAgreement::sum(std::vector<double> values) const {
  if (world() == 1) return values;
  auto t = doubles(values, device_);
  all_reduce(t, /*max=*/false);
  auto host = t.cpu();
  for (size_t i = 0; i < values.size(); ++i) values[i] = host[static_cast<int64_t>(i)].item<double>();
  return values;
}

double RankAgreement::mean(double value) const { return sum(value) / world(); }

double RankAgreement::max(double value) const {
  if (world() == 1) return value;
  auto t = doubles({value}, device_);
  all_reduce(t, /*max=*/true);
  return t.item<double>();
}

double RankAgreement::min(double value) const { return -max(-value); }

torch::Tensor RankAgreement::gather_rows(const torch::Tensor& rows) const {
  auto mine = rows.to(torch::kLong).contiguous();
  if (world() == 1) return mine.unsqueeze(0);
  auto input = mine.flatten().to(device_);
  auto all = torch::empty({world() * input.numel()}, input.options());
  if (dp_) dp_->group_all_gather(all, input);
  else group_->all_gather_async(all, input).wait();
  auto shape = mine.sizes().vec();
  shape.insert(shape.begin(), world());
  return all.cpu().view(shape);
}

std::vector<int64_t> RankAgreement::from_rank0(std::vector<int64_t> values) const {
  if (world() == 1 || values.empty()) return values;
  auto t = torch::tensor(values, torch::kLong).to(device_);
  if (dp_) dp_->group_broadcast(t, 0);
  else group_->broadcast(t, 0);
  auto host = t.cpu();
  for (size_t i = 0; i < values.size(); ++i) values[i] = host[static_cast<int64_t>(i)].item<int64_t>();
  return values;
}

}  // namespace memtrain
