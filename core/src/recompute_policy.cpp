#include "memtrain/core/recompute_policy.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "memtrain/core/config.h"
#include "memtrain/core/error.h"

namespace memtrain {

RecomputePolicy RecomputePolicy::parse(const std::string& text) {
  // The one grammar of memory.recompute: Config::validate calls this too.
  RecomputePolicy p;
  const std::string allowed = "expected none | all | every:K (whole K >= 1) | attn | mlp | budget:MiB (> 0)";
  auto bad = [&] { return ConfigError("[config] memory.recompute = '" + text + "' is not allowed; " + allowed); };
  if (text == "none") {
    p.mode = Mode::kNone;
  } else if (text == "all") {
    p.mode = Mode::kAll;
  } else if (text == "attn" || text == "mlp") {
    p.mode = Mode::kPart;
    p.part = text;
  } else if (text.rfind("every:", 0) == 0) {
    p.mode = Mode::kEvery;
    const auto every = detail::parse_count(text.substr(6));
    if (!every) throw bad();
    p.every = *every;
  } else if (text.rfind("budget:", 0) == 0) {
    p.mode = Mode::kBudget;
    try {
      size_t used = 0;
      p.budget_mib = std::stod(text.substr(7), &used);
      if (used != text.size() - 7) throw bad();
    } catch (const std::logic_error&) {  // stod: not a number, or out of range
      throw bad();
    }
    if (!(p.budget_mib > 0) || !std::isfinite(p.budget_mib)) throw bad();
  } else {
    throw bad();
  }
  return p;
}

std::string RecomputePolicy::describe() const {
  std::ostringstream os;
  switch (mode) {
    case Mode::kNone: os << "none"; break;
    case Mode::kAll: os << "all blocks"; break;
    case Mode::kEvery: os << "every " << every << " blocks"; break;
    case Mode::kPart: os << "the " << part << " part of every block"; break;
    case Mode::kBudget: {
      os << "budget " << budget_mib << " MiB";
      if (!blocks.empty()) {
        os << ": blocks";
        for (size_t i = 0; i < blocks.size(); ++i)
          if (blocks[i]) os << " " << i;
      }
      break;
    }
  }
  if (offload && mode != Mode::kNone) os << ", inputs offloaded to CPU";
  return os.str();
}

bool RecomputePolicy::checkpoints_block(int64_t i) const {
  switch (mode) {
    case Mode::kAll: return true;
    case Mode::kEvery: return i % every == 0;
    case Mode::kBudget: return blocks.empty() || (i < static_cast<int64_t>(blocks.size()) && blocks[i]);
    default: return false;
  }
}

}  // namespace memtrain
