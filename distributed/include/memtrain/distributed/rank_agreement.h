// Ranks agreeing on host values outside the step's own collectives: whether every rank is ok, whether any
// asked to stop, sums and means of logged numbers, the largest of a value, rows of int64 from every rank.
// Each call is a collective when there are ranks (every rank must call it, in the same order, whatever its
// data); in one process it returns the value as it is. The bytes are not counted as a step's traffic.
//
//   RankAgreement ranks(trainer.data_parallel(), device);
//   if (!ranks.all(saved_ok)) throw ...;            // every rank refuses together
//   const double loss = ranks.mean(local_loss);     // the mean over ranks
//   auto rows = ranks.gather_rows(mine);            // (world, rows, fields) int64 on the host
//   auto plan = ranks.from_rank0({chosen_index});   // rank 0 decides, every rank applies its choice
#pragma once

#include <torch/types.h>

#include <vector>

namespace memtrain {

class DataParallel;
class ProcessGroup;

class RankAgreement {
 public:
  // Through `dp` (its process group, outside the step's traffic) once it exists; through `group` before (the
  // planner decides before the buckets are made); neither: one process.
  RankAgreement(DataParallel* dp, ProcessGroup* group, c10::Device device) : dp_(dp), group_(group), device_(device) {}

  bool all(bool ok) const;         // true on every rank
  bool any(bool flag) const;       // true on some rank
  double sum(double value) const;
  std::vector<double> sum(std::vector<double> values) const;  // element by element, in one collective
  double mean(double value) const;
  double max(double value) const;
  double min(double value) const;
  // Every rank's `rows` (the same shape on every rank), stacked: (world, rows...) int64 on the host.
  torch::Tensor gather_rows(const torch::Tensor& rows) const;
  // Rank 0's values on every rank (a broadcast): where each rank could measure differently, rank 0 decides.
  std::vector<int64_t> from_rank0(std::vector<int64_t> values) const;
  int world() const;

 private:
  void all_reduce(torch::Tensor& t, bool max) const;
  DataParallel* dp_;
  ProcessGroup* group_;
  c10::Device device_;
};

}  // namespace memtrain
