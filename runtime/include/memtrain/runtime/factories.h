// The factories that turn a Config into parts: the only place where the config's sections meet the
// components' own options structs (GPTOptions, TextDataOptions, OptimizerOptions, ...). The components
// below know nothing of Config; an embedder who builds parts by hand never needs these.
//
//   auto data = memtrain::make_dataset(cfg, {.rank = 0, .world = 1});
//   auto model = memtrain::make_model(cfg.model, data->info());
//   auto opt = memtrain::make_optimizer(memtrain::optimizer_options(cfg.train), model->named_parameters());
#pragma once

#include <memory>

#include "memtrain/core/config.h"
#include "memtrain/data/datasets.h"
#include "memtrain/models/family.h"
#include "memtrain/models/gpt.h"
#include "memtrain/models/llama.h"
#include "memtrain/models/lora.h"
#include "memtrain/models/nf4.h"
#include "memtrain/models/model.h"
#include "memtrain/distributed/data_parallel.h"
#include "memtrain/distributed/parallel_dims.h"
#include "memtrain/optim/optimizer.h"
#include "memtrain/runtime/memory_estimate.h"
#include "memtrain/runtime/precision.h"

namespace memtrain {

// model.name (choices::model_name) with its keys; the vocabulary or image shape from the data.
// `how.shapes_only`: parameters with their sizes and no memory (a family with `init`: GPT, Llama, Phi-3), which
// the trainer gives memory and fills; else initialised whole by the family's modules.
std::shared_ptr<Model> make_model(const ModelConfig& config, const DataInfo& data, const ParameterBuild& how = {});
// data.dataset (choices::dataset); a language model's context length from [model].
std::unique_ptr<Dataset> make_dataset(const Config& config, const Shard& shard);
// A language model's context length: model.block_size, or its family's (a GPT preset's).
int64_t context_length(const ModelConfig& config);
// The models that read token ids (their family's reads_tokens: gpt and llama).
bool is_language_model(const ModelConfig& config);
// The models whose family gives a shape for the closed-form estimate (gpt and llama); the others are probed.
bool has_closed_form(const ModelConfig& config);
// The families that have one, as prose: "gpt, llama and phi3".
std::string closed_form_families();
// gpt_options and llama_options (models/gpt.h, models/llama.h): the options a config describes.
// What the config fixes in an estimate's inputs: bytes per element of the parameters (bf16 or fp32), masters and
// optimizer state (low-bit: which of `trained`, the trained tensors' elements, are quantized), [dist] for `world`
// ranks, and the batch. `world` counts every rank; with dist.tensor_parallel = T, ZeRO shards over world / T.
// `whole`: each trained tensor's whole parameter's elements when `trained` holds tensor-parallel slices (a slice's
// state is quantized as its whole parameter's); empty: `trained` itself.
EstimateInputs estimate_settings(const TrainOptions& train, const DistConfig& dist, int world, bool bf16_parameters,
                                 const std::vector<int64_t>& trained, const std::vector<int64_t>& whole = {});
// The estimate's model states for gpt and llama without building the model or reading data (each tensor's
// elements by arithmetic), for `world` ranks; no activations (its probe is empty). ConfigError for other
// models and for [lora] / train.freeze (not counted here yet).
EstimateInputs model_state_inputs(const Config& config, int world);
// The vocabulary of the config's gpt or llama without reading data (the key, the preset's, or byte text's 256),
// and the shape its activations are estimated from in closed form (ConfigError for other models).
int64_t config_vocab(const Config& config);
// ZeRO 2-3 without accumulation's held part: the bytes per trained element of a rank's reduced gradient part (4 / N
// with fp32 masters, else the parameter bytes / N; N: the world's data-parallel ranks), which the closed form places in backward; 0 where the model
// states count it (stages 0-1, a part held across micro-batches, or offloaded to a GPU's host).
double reduced_part_bytes_per_element(const TrainOptions& train, const DistConfig& dist, int world, bool cuda);
TransformerShape config_transformer_shape(const Config& config);
// [lora] as the adapters' options.
LoraOptions lora_options(const LoraConfig& lora);
// lora.quantize_block / double_quant as NF4's options (models/nf4.h); where an NF4 base's values come from, for the
// checkpoint's record ("model.init_from DIR" or "train.seed N").
Nf4Options nf4_options(const LoraConfig& lora);
std::string nf4_source(const Config& config);
// What trains, on a built model: with lora.rank > 0 the adapters (and lora.init_from's weights) are added and
// everything else frozen; else train.freeze's matches are frozen. Returns the adapted modules and the number
// of parameters frozen (both 0 when neither is set).
struct TrainableSelection {
  std::vector<std::string> adapted;
  int64_t frozen = 0;
  std::map<std::string, torch::Tensor> adapters;  // lora.init_from's, whole (a split model holds slices of them)
};
TrainableSelection select_trainable(Model& model, const Config& config);
// train.optimizer (choices::optimizer) and its hyper-parameters.
OptimizerOptions optimizer_options(const TrainOptions& train);
// Whether train.optimizer makes a PartialStepOptimizer (element-wise: fused AdamW, 8- and 4-bit AdamW), which can
// step some of its tensors at a time with the same bits.
bool steps_in_parts(const std::string& optimizer);
// adamw8bit / adamw4bit: values per absmax (train.optimizer_block, or the kind's default); 0 for the others.
int64_t optimizer_block(const TrainOptions& train);
// train.lr / min_lr / warmup_steps / steps: the cosine schedule.
CosineScheduleOptions schedule_options(const TrainOptions& train);
// train.loss_scale_*: fp16's dynamic loss scaler.
GradScalerOptions scaler_options(const TrainOptions& train);
// [dist] for DataParallel. Gradients are reduced after every micro-batch with dist.reduce = micro_batch, with
// bf16 parameters (each micro-batch's gradient goes to the fp32 masters, as in one process) and in stage 3;
// `units`: stage 3's unit of each parameter (ignored by the other stages).
DataParallelOptions data_parallel_options(const Config& config, const ParallelDims& dims, bool bf16_parameters,
                                          const std::vector<int64_t>& units);

}  // namespace memtrain
