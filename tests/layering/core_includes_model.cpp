// Must NOT compile: the bottom layer (core/) including a model header. Built against memtrain::core by
// Layering.CoreCannotIncludeModels.
#include "memtrain/models/model.h"
