// Precompiled header: the LibTorch headers every memtrain translation unit needs. Compiled once per
// target; keep it to headers that are both heavy and widely used.
#pragma once
#include <torch/torch.h>
