// mok's one error type. Every check that rejects an input names the argument, what was expected
// and what was seen, so a user can fix the call without reading mok's source.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace mok {

class Error : public std::runtime_error {
 public:
  // `argument`: the name the caller knows (e.g. "topk", "x.shape[1]", "config.minibatch_size").
  Error(std::string argument, std::string expected, std::string actual)
      : std::runtime_error(format(argument, expected, actual)),
        argument_(std::move(argument)),
        expected_(std::move(expected)),
        actual_(std::move(actual)) {}

  // A failure that is not about one argument (a backend that is missing, a device error).
  explicit Error(const std::string& message) : std::runtime_error("mok: " + message) {}

  const std::string& argument() const { return argument_; }
  const std::string& expected() const { return expected_; }
  const std::string& actual() const { return actual_; }

 private:
  static std::string format(const std::string& argument, const std::string& expected,
                            const std::string& actual) {
    return "mok: invalid " + argument + ": expected " + expected + ", got " + actual;
  }

  std::string argument_, expected_, actual_;
};

// Renders any streamable value for an error message.
template <typename T>
std::string to_text(const T& value) {
  std::ostringstream s;
  s << value;
  return s.str();
}

}  // namespace mok
