// memtrain's errors: exceptions that carry their component, what was wrong, what was expected and,
// where one helps, a hint. Library code throws; only the binary turns them into an exit code.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace memtrain {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ConfigError : public Error {  // a config file, key or value
 public:
  using Error::Error;
};

class DataError : public Error {  // missing, short or corrupt data
 public:
  using Error::Error;
};

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}
}  // namespace detail

}  // namespace memtrain

// MEMTRAIN_CHECK(cond, ErrorType, "[component] message parts", ...): throw ErrorType with the message.
#define MEMTRAIN_CHECK(cond, ErrorType, ...)                                 \
  do {                                                                       \
    if (!(cond)) throw ErrorType(::memtrain::detail::concat(__VA_ARGS__));   \
  } while (false)
