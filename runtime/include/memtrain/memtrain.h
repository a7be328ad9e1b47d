// memtrain's public API in one include, for applications that embed it:
//
//   #include <memtrain/memtrain.h>
//   int main() {
//     memtrain::cpu_memory::install();   // before any tensor exists: CPU bytes are counted
//     ...
//   }
//
// Finer-grained headers live under memtrain/core, models, data, optim, distributed and runtime.
#pragma once

#include "memtrain/core/recompute_policy.h"
#include "memtrain/core/config.h"
#include "memtrain/core/cpu_memory.h"
#include "memtrain/core/data_info.h"
#include "memtrain/core/error.h"
#include "memtrain/core/memory_tracker.h"
#include "memtrain/core/safetensors.h"
#include "memtrain/core/files.h"
#include "memtrain/core/hugging_face_config.h"
#include "memtrain/core/state_checkpoint.h"
#include "memtrain/data/datasets.h"
#include "memtrain/distributed/world.h"
#include "memtrain/models/gpt.h"
#include "memtrain/models/hugging_face.h"
#include "memtrain/models/llama.h"
#include "memtrain/models/lora.h"
#include "memtrain/models/mlp.h"
#include "memtrain/models/model.h"
#include "memtrain/models/module_model.h"
#include "memtrain/models/resnet.h"
#include "memtrain/optim/lowbit_adamw.h"
#include "memtrain/optim/optimizer.h"
#include "memtrain/runtime/recompute.h"
#include "memtrain/runtime/factories.h"
#include "memtrain/runtime/fused_loss.h"
#include "memtrain/runtime/generate.h"
#include "memtrain/runtime/device.h"
#include "memtrain/runtime/export.h"
#include "memtrain/runtime/precision.h"
#include "memtrain/runtime/run_report.h"
#include "memtrain/runtime/trainer.h"
