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

// tiny, then the standard cases of docs/perf/method.md.
const Preset* find_preset(const std::string& name);
std::string preset_list();

// --precision: the bf16 layer, or the FP8 layer (api.hpp, Fp8Weights: routed GEMMs in e4m3),
// or the FP8 layer with its three routed weight gradients computed as the bf16 layer computes
// them (BackwardOptions::fp8_weight_grads false; Python's precision "fp8-bf16-wgrad").
enum class Precision : std::uint8_t { bf16, fp8, fp8_bf16_wgrad };
const char* precision_name(Precision p);
// Whether `p` runs the FP8 layer (its forward and input gradients on e4m3): fp8 and
// fp8-bf16-wgrad.
bool is_fp8(Precision p);
// The BackwardOptions a step of `p` passes to the FP8 layer's backward.
BackwardOptions backward_options(Precision p);

// --check: compare everything, a sample of tokens and weight slices, or decide by cost.
enum class CheckSize : std::uint8_t { automatic, full, sampled };

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
  Precision precision = Precision::bf16;
  CheckSize check = CheckSize::automatic;
};

int run(const RunArgs& args);

// `mok run --plan`: every workspace buffer's bytes for the shape and config
// (src/core/workspace_plan.hpp).
int print_plan(const RunArgs& args);

}  // namespace mok::cli
