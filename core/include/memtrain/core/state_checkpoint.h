// Training-state checkpoints on disk: a folder per checkpoint with one safetensors file per rank and a
// JSON manifest, written so that a crash at any moment leaves the previous checkpoint intact.
//
//   <dir>/step-000100/rank-00000.safetensors   each rank's pieces: elements [begin, end) of the
//                     rank-00001.safetensors   flattened full tensors it owns (name-keyed, no addresses)
//                     manifest.json            step, world size, ZeRO stage, config; every tensor's
//                                              shape, dtype and pieces; every file's size and CRC-32
//   <dir>/latest                               "step-000100", written last
//
// Saving: every rank calls write_rank_file() into staging_folder(dir, step); when all have, rank 0
// calls commit_checkpoint() with their sizes and checksums, which writes the manifest,
// renames the staging folder to its final name (atomic), updates `latest` and prunes old checkpoints.
// A staging folder never counts as a checkpoint. Loading (load_checkpoint) checks everything before
// it returns a tensor: a flipped byte, a truncated or missing file, a manifest that does not match the
// files, or pieces that do not cover a tensor exactly are DataErrors naming the file and the tensor.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "memtrain/core/safetensors.h"

namespace memtrain {

// One rank's part of one tensor: elements [begin, end) of the full tensor, flattened.
struct ShardPiece {
  std::string name;                // e.g. "model/blocks.0.attn.c_attn.weight", "optim/.../exp_avg"
  std::vector<int64_t> full_shape;
  int64_t begin = 0;
  int64_t end = 0;
  torch::Tensor data;              // (end - begin,) elements, any device
};

struct CheckpointMeta {
  int64_t step = 0;                            // optimizer steps done
  int world_size = 1;
  int zero_stage = 0;
  std::map<std::string, std::string> fields;   // config (INI), param_dtype, optimizer, plan, ...
};

struct LoadedCheckpoint {
  std::string path;
  CheckpointMeta meta;
  std::map<std::string, torch::Tensor> tensors;  // full tensors, their saved shape and dtype, on the CPU
};

// "<dir>/step-000100" and the folder the ranks write it into first.
std::string checkpoint_folder(const std::string& dir, int64_t step);
std::string staging_folder(const std::string& dir, int64_t step);

// Writes this rank's file (fsynced) into `staging`; every rank writes one, possibly with no pieces.
// Returns its size and CRC-32, which rank 0 needs for the manifest.
SavedFile write_rank_file(const std::string& staging, int rank, const std::vector<ShardPiece>& pieces);

// Rank 0, after every rank's write_rank_file, with what each returned (by rank): manifest, rename,
// `latest`, then all but the newest `keep` checkpoints (and stale staging folders) removed. Reads the
// files' headers only. Returns the checkpoint's folder.
std::string commit_checkpoint(const std::string& dir, const CheckpointMeta& meta, const std::vector<SavedFile>& files,
                              int64_t keep);

// The newest complete checkpoint under `dir` (`latest` if it names one, else the highest step-* folder
// with a manifest); "" if there is none.
std::string find_latest_checkpoint(const std::string& dir);
// Complete checkpoints under `dir`, oldest first.
std::vector<std::string> list_checkpoints(const std::string& dir);

// Reads and checks a whole checkpoint (see the top of this file); throws DataError naming what is wrong.
LoadedCheckpoint load_checkpoint(const std::string& path);
// Only the manifest (checked for form, not against the files).
CheckpointMeta read_manifest(const std::string& path);

}  // namespace memtrain
