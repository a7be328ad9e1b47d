// What a dataset tells a model about its shape: the vocabulary for text, the image shape and classes
// for images. Lives at the bottom layer so that models and data need not know each other.
#pragma once

#include <cstdint>

namespace memtrain {

struct DataInfo {
  int64_t vocab_size = 0;   // text
  int64_t channels = 1;     // images
  int64_t image_size = 28;
  int64_t num_classes = 10;
};

}  // namespace memtrain
