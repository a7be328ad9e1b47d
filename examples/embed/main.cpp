// An application that trains its own networks with memtrain, using only the installed package:
//   - its own dataset class (bars: 16 x 16 images of a horizontal or vertical bar in noise),
//   - a convolutional network written as an ordinary torch::nn::Sequential, trained through
//     memtrain::ModuleModel (each child a block that checkpointing recomputes),
//   - a recurrent network (GRU over the image's rows) written as a memtrain::Model subclass,
// each trained with a config built in code: every block checkpointed, 2 micro-batches per step, bf16
// autocast. It prints each run's losses and memtrain's memory table.
//
//   embed_train [steps]          (default 300)
#include <memtrain/memtrain.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

namespace {

// Bars: class 0 has one bright row, class 1 one bright column, both at a random place in Gaussian
// noise. Batches are a pure function of (step, micro-batch), as memtrain's own datasets are.
class BarsDataset : public memtrain::Dataset {
 public:
  memtrain::DataInfo info() const override { return {.channels = 1, .image_size = 16, .num_classes = 2}; }

  memtrain::Batch train_batch(int64_t step, int64_t micro, int64_t batch_size) override {
    return make(1000003 * step + micro, batch_size);
  }
  std::vector<memtrain::Batch> val_batches(int64_t batch_size, int64_t max_batches) override {
    std::vector<memtrain::Batch> out;
    for (int64_t b = 0; b < max_batches; ++b) out.push_back(make(-1 - b, batch_size));
    return out;
  }
  std::string describe() const override { return "bars: 16 x 16 images, a row or a column"; }

 private:
  static memtrain::Batch make(int64_t seed, int64_t n) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed) + 12345);
    auto labels = torch::randint(0, 2, {n}, gen, torch::kLong);
    auto where = torch::randint(0, 16, {n}, gen, torch::kLong);
    auto images = 0.5 * torch::randn({n, 1, 16, 16}, gen);
    auto line = torch::nn::functional::one_hot(where, 16).to(torch::kFloat);  // (n, 16)
    auto rows = line.unsqueeze(2).expand({n, 16, 16}), cols = line.unsqueeze(1).expand({n, 16, 16});
    images += torch::where(labels.view({n, 1, 1}) == 0, rows, cols).unsqueeze(1);
    return {images, labels};
  }
};

// A GRU that reads the image row by row: embed (rows -> width 32), two residual GRU blocks, and a
// linear head on the last step. The Model contract: embed, blocks with their parameters, head.
class RowGru : public memtrain::Model {
 public:
  RowGru() {
    in_ = register_module("in", torch::nn::Linear(16, 32));
    for (int i = 0; i < 2; ++i)
      grus_.push_back(register_module("gru" + std::to_string(i),
                                      torch::nn::GRU(torch::nn::GRUOptions(32, 32).batch_first(true))));
    out_ = register_module("out", torch::nn::Linear(32, 2));
  }
  torch::Tensor embed(const torch::Tensor& x) override { return in_->forward(x.squeeze(1)); }  // (B, 16, 32)
  int64_t num_blocks() const override { return static_cast<int64_t>(grus_.size()); }
  torch::Tensor block_part(int64_t i, size_t, const torch::Tensor& h) override {
    return h + std::get<0>(grus_[i]->forward(h));
  }
  std::vector<torch::Tensor> block_parameters(int64_t i) const override { return grus_[i]->parameters(); }
  torch::Tensor head(const torch::Tensor& h) override { return out_->forward(h.select(1, -1)); }
  std::string describe() const override { return "row GRU, 2 blocks, " + std::to_string(num_parameters()) + " parameters"; }

 private:
  torch::nn::Linear in_{nullptr}, out_{nullptr};
  std::vector<torch::nn::GRU> grus_;
};

memtrain::Config config_for(const std::string& name, int64_t steps) {
  memtrain::Config c;
  c.train.steps = steps;
  c.train.micro_batch = 16;
  c.train.accum_steps = 2;
  c.train.precision = "bf16";
  c.train.lr = 3e-3;
  c.train.min_lr = 3e-4;
  c.train.warmup_steps = 10;
  c.memory.recompute = "all";
  c.log.dir = (std::filesystem::temp_directory_path() / "memtrain-embed").string();
  c.log.name = name;
  c.validate();  // the same checks as a config file gets
  return c;
}

// Trains step by step in this loop and prints the mean loss of the first and last 20 steps. The RunReport
// writes the same run folder as Trainer::fit() (config.ini, metrics.jsonl, memory.rank0.jsonl, summary.json)
// and the same console lines.
void train(const std::string& name, std::shared_ptr<memtrain::Model> model, int64_t steps) {
  memtrain::Trainer trainer(config_for(name, steps), model, std::make_shared<BarsDataset>());
  std::cout << "== " << name << ": " << model->describe() << "\n";
  memtrain::RunReport report(trainer);
  std::vector<torch::Tensor> losses;
  for (int64_t s = 0; s < steps; ++s) {
    auto r = trainer.step();
    losses.push_back(r.loss);  // read on the host below, once
    report.step(r);            // the step line and metrics.jsonl on log steps (log.every)
  }
  auto mean = [&](int64_t from, int64_t to) { return torch::stack(std::vector(losses.begin() + from, losses.begin() + to)).mean().item<double>(); };
  const int64_t k = std::min<int64_t>(20, steps);
  auto eval = trainer.evaluate(trainer.data().val_batches(64, 4));
  report.finish(eval);  // the memory tables
  report.close();       // summary.json
  std::cout << name << " loss: first " << mean(0, k) << " last " << mean(steps - k, steps) << " | validation accuracy "
            << 100 * eval.accuracy << "%\n"
            << trainer.tracker().summary_table();
}

}  // namespace

int main(int argc, char** argv) {
  memtrain::cpu_memory::install();  // before any tensor: memtrain counts every CPU byte from here on
  const int64_t steps = argc > 1 ? std::atoll(argv[1]) : 300;
  try {
    torch::manual_seed(0);
    // Convolutional network as a plain Sequential: 5 blocks (conv, relu, pool, flatten, linear).
    torch::nn::Sequential cnn(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)), torch::nn::ReLU(),
                              torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(4)), torch::nn::Flatten(),
                              torch::nn::Linear(8 * 4 * 4, 2));
    train("cnn", std::make_shared<memtrain::ModuleModel>(cnn, memtrain::ModuleModelOptions{.name = "bars CNN"}), steps);
    train("gru", std::make_shared<RowGru>(), steps);
  } catch (const std::exception& e) {
    std::cerr << "embed_train: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
