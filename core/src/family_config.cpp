#include "memtrain/core/family_config.h"

#include <algorithm>

#include "memtrain/core/error.h"

namespace memtrain {

namespace {
FamilySource& source() {
  static FamilySource s = nullptr;
  return s;
}
}  // namespace

void set_family_source(FamilySource s) { source() = s; }

const std::vector<const FamilyConfig*>& family_configs() {
  MEMTRAIN_CHECK(source() != nullptr, ConfigError,
                 "[config] no model family is registered: link memtrain::models (or memtrain::memtrain), whose "
                 "families the config reads");
  return source()();
}

std::string family_names() {
  std::string out;
  for (const auto* f : family_configs()) out += (out.empty() ? "" : " | ") + f->name;
  return out;
}

const FamilyConfig& family_config(const std::string& name) {
  for (const auto* f : family_configs())
    if (f->name == name) return *f;
  throw ConfigError("[config] model.name = '" + name + "' is no model family of this build; expected " + family_names());
}

const FamilyConfig* family_with_preset(const std::string& preset) {
  if (preset == "custom") return nullptr;
  for (const auto* f : family_configs())
    if (std::find(f->presets.begin(), f->presets.end(), preset) != f->presets.end()) return f;
  return nullptr;
}

}  // namespace memtrain
