// Must NOT compile: a model (layer models/) including the trainer (layer runtime/, above it). The test
// Layering.ModelsCannotIncludeTheTrainer builds this against memtrain::models and expects the include
// to be missing from its include path.
#include "memtrain/runtime/trainer.h"
