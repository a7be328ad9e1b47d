// Ranks agreeing on host values outside the step's own collectives: whether every rank is ok, whether any
// asked to stop, sums and means of logged numbers, the largest of a value, rows of int64 from every rank.
// Each call is a collective when there are ranks (every rank must call it, in the same order, whatever its
// data); in one process it returns the value as it is. The bytes are not counted as a step's traffic.
//
//   RankAgreement ranks(trainer.data_parallel(), device);
//   if (!ranks.all(saved_ok)) throw ...;            // every rank refuses together
//   const double loss = ranks.mean(local_loss);     // the mean over ranks
//   auto rows = ranks.gather_rows(mine);            // (world, rows, fields) int64 on the host
#pragma once

#include <torch/types.h>

#include <vector>

namespace memtrain {

class DataParallel;

class RankAgreement {
 public:
  // `dp`: the run's data-parallel engine (its process group), or null in one process.
  RankAgreement(DataParallel* dp, c10::Device device) : dp_(dp), device_(device) {}

  bool all(bool ok) const;         // true on every rank
  bool any(bool flag) const;       // true on some rank
  double sum(double value) const;
  std::vector<double> sum(std::vector<double> values) const;  // element by element, in one collective
  double mean(double value) const;
  double max(double value) const;
  double min(double value) const;
  // Every rank's `rows` (the same shape on every rank), stacked: (world, rows...) int64 on the host.
  torch::Tensor gather_rows(const torch::Tensor& rows) const;
  int world() const;

 private:
  DataParallel* dp_;
  c10::Device device_;
};

}  // namespace memtrain
