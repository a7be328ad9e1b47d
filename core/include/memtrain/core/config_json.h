// A Hugging Face config.json, read with messages that name the file and the key: what each family's reader
// (FamilyConfig::read_hugging_face, beside its model) uses. Needs nlohmann/json (memtrain's private dependency:
// include it from memtrain's own sources, not from an application).
//
//   ConfigJson j("hf/Llama-3.2-1B");
//   m.n_layer = j.get<int64_t>("num_hidden_layers");
//   if (j.get<bool>("mlp_bias", false)) j.unsupported("mlp_bias = true", "false");
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "memtrain/core/config.h"
#include "memtrain/core/error.h"

namespace memtrain {

class ConfigJson {
 public:
  // DIR/config.json; ConfigError for a missing folder or file, or text that is not a JSON object.
  explicit ConfigJson(const std::string& dir);
  const std::string& path() const { return path_; }
  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  const nlohmann::json& at(const char* key) const {
    MEMTRAIN_CHECK(has(key), ConfigError, "[config] ", path_, ": no '", key, "'");
    return j_[key];
  }
  template <class T>
  T get(const char* key) const {
    try {
      return at(key).get<T>();
    } catch (const nlohmann::json::exception&) {
      throw ConfigError(detail::concat("[config] ", path_, ": '", key, "' = ", at(key).dump(), " has the wrong type"));
    }
  }
  template <class T>
  T get(const char* key, T fallback) const {
    return has(key) ? get<T>(key) : fallback;
  }
  // An option memtrain does not implement: an error naming it and what is supported.
  [[noreturn]] void unsupported(const std::string& what, const std::string& expected) const {
    throw ConfigError(detail::concat("[config] ", path_, ": ", what, " is not implemented by memtrain (expected ",
                                     expected, ")"));
  }

 private:
  std::string path_;
  nlohmann::json j_;
};

}  // namespace memtrain
