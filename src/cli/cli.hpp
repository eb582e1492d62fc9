// The `mok` command: argument parsing (main.cpp) and the `run` subcommand (run.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "mok/api.hpp"
#include "synthetic/synthetic.hpp"

namespace mok::cli {

// A bad command line: printed as one line on stderr, exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Preset {
  const char* name;
  const char* what;
  Problem problem;
};

// tiny, then the cases of PERF.md's standard suite.
const Preset* find_preset(const std::string& name);
std::string preset_list();

struct RunArgs {
  std::string preset = "tiny";
  Problem problem;  // the preset with any --tokens/--hidden/... applied
  Backend backend = Backend::automatic;
  Routing routing = Routing::softmax;
  std::uint64_t seed = 1;
  int threads = 0;
  bool json = false;
  Config config;      // --minibatch / --macrobatch / --forward / --stage-rows
  std::optional<float> swiglu_limit;  // --swiglu-limit: clamped SwiGLU (Weights::swiglu_limit)
  bool plan = false;  // --plan: print the workspace plan instead of running
};

int run(const RunArgs& args);

// `mok run --plan`: every workspace buffer's bytes for the shape and config
// (src/core/workspace_plan.hpp).
int print_plan(const RunArgs& args);

}  // namespace mok::cli
