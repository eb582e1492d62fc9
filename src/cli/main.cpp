// mok: run one MoE layer training step on synthetic data, checked against the f64 reference.
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "cli/cli.hpp"
#include "mok/version.hpp"

namespace mok::cli {
namespace {

constexpr Preset kPresets[] = {
    {"tiny",
     "a small layer for a quick check (the default)",
     {.num_tokens = 256,
      .hidden_size = 256,
      .intermediate_size = 128,
      .num_experts = 8,
      .topk = 2,
      .shared_intermediate_size = 128}},
    {"dsv3-ep8slice",
     "one rank's work in DeepSeek-V3 at EP=8",
     {.num_tokens = 4096,
      .hidden_size = 7168,
      .intermediate_size = 2048,
      .num_experts = 32,
      .topk = 8,
      .shared_intermediate_size = 2048}},
    {"dsv3-ep1",
     "all 256 DeepSeek-V3 experts on one GPU",
     {.num_tokens = 4096,
      .hidden_size = 7168,
      .intermediate_size = 2048,
      .num_experts = 256,
      .topk = 8,
      .shared_intermediate_size = 2048}},
    {"qwen3-30b-a3b",
     "Qwen3-30B-A3B",
     {.num_tokens = 16384,
      .hidden_size = 2048,
      .intermediate_size = 768,
      .num_experts = 128,
      .topk = 8,
      .shared_intermediate_size = 0}},
    {"mixtral-8x7b",
     "Mixtral 8x7B",
     {.num_tokens = 8192,
      .hidden_size = 4096,
      .intermediate_size = 14336,
      .num_experts = 8,
      .topk = 2,
      .shared_intermediate_size = 0}},
};

constexpr const char* kHelp = R"(mok %s: a Mixture-of-Experts training layer for NVIDIA Hopper GPUs.

usage:
  mok run [options]     run one training step (forward + backward) of one MoE layer on seeded
                        synthetic inputs, check it against the f64 reference, print times and errors
  mok --help | --version

run options:
  --preset NAME         layer shape (default tiny): %s
  --tokens T            tokens on this rank (any T >= 1)
  --hidden H            hidden size (a multiple of 64)
  --intermediate I      routed experts' intermediate size (a multiple of 64)
  --experts E           number of experts
  --topk K              routed experts per token (1 <= K <= E)
  --shared S            shared expert's intermediate size (0: none; else a multiple of 64)
                        (these override the preset's values)
  --routing R           uniform (softmax top-k router, default) | skewed (expert 0 takes half
                        of all rows) | one-expert (every row on expert 0)
  --backend B           auto (default) | cpu | cuda
  --threads N           CPU threads (default: all)
  --seed N              seed of the synthetic inputs, weights and router (default 1)
  --json                print one JSON object instead of text
  --precision P         bf16 (default) | fp8: the FP8 layer, every routed-expert GEMM on e4m3
                        operands with block scales (H and I multiples of 128); the routed weights
                        are quantized first, timed on their own. Checked against the CPU FP8 layer
                        (bitwise on the CPU backend; on CUDA sum|diff|/sum|ref| <= 2^-5 and every
                        row <= 1/4) and against the f64 layer of the unquantized bf16 values with
                        MoK's MXFP8 bounds (abs max <= 1 on out and d_x, sum|diff|/sum|ref| <= 0.1,
                        cosine >= 0.996), both errors printed per output and gradient |
                        fp8-bf16-wgrad: the same FP8 layer with the three routed weight gradients
                        computed as the bf16 layer computes them, bf16 products of the bf16 rows
                        (BackwardOptions::fp8_weight_grads false); checked the same way, the CPU
                        FP8 layer computing them likewise
  --check C             auto (default: a sample where the f64 layer costs over 2e10 FLOPs) | full |
                        sampled: what the checks compare
  --plan                print the workspace plan (every buffer's bytes: symmetric, local and layer) for
                        the shape and config, and exit; with --precision fp8 (or fp8-bf16-wgrad)
                        also the FP8 scratch, the quantized weights and the forward context: the
                        memory per layer
  --ep-size W           ranks in the expert-parallel group (default 1; the CPU run needs 1)
  --minibatch N         config.minibatch_size, rows (default 4096)
  --macrobatch N        config.macrobatch_size, rows of the ring buffer (default 0: automatic, 131072
                        routed rows plus each local expert's padding to the tile)
  --forward P           config.forward_path on the CUDA backend: launches (default) | fused (the
                        forward megakernel; the same bits)
  --stage-rows N        config.fused_stage_rows, the fused forward's stage (default 0: automatic)
  --swiglu-limit L      clamped SwiGLU, silu(min(g, L)) * clamp(u, -L, L) (MoK's swiglu_limit; a
                        finite positive number; default: none, the plain SwiGLU). The check's
                        tolerances do not model the clamp's kink: with L small enough that many
                        g, u lie near +-L (below ~4 here) a few of them round to the other side
                        of the clamp than in the f64 layer and the gradient check can fail

The check compares every output and gradient with the exact f64 layer on the same bf16 inputs
(relative Frobenius error, tolerances derived from bf16 rounding; with the FP8 precisions as
above); large layers are checked on a sample of tokens and weight slices. Exit status: 0 passed,
1 check failed, 2 bad arguments.
)";

std::int64_t parse_int(const std::string& flag, const std::string& value) {
  std::int64_t v = 0;
  const char* end = value.data() + value.size();
  auto [ptr, ec] = std::from_chars(value.data(), end, v);
  if (ec != std::errc() || ptr != end) {
    throw UsageError(flag + ": expected an integer, got '" + value + "'");
  }
  return v;
}

RunArgs parse_run(const std::vector<std::string>& argv) {
  RunArgs a;
  // The preset first, so shape flags override it wherever they appear.
  for (std::size_t i = 0; i + 1 < argv.size(); ++i) {
    if (argv[i] == "--preset") a.preset = argv[i + 1];
  }
  const Preset* preset = find_preset(a.preset);
  if (!preset) {
    throw UsageError("--preset: unknown preset '" + a.preset + "' (known: " + preset_list() + ")");
  }
  a.problem = preset->problem;
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string& flag = argv[i];
    if (flag == "--json") {
      a.json = true;
      continue;
    }
    if (flag == "--plan") {
      a.plan = true;
      continue;
    }
    if (flag.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + flag + "'");
    if (i + 1 >= argv.size()) throw UsageError(flag + ": missing value");
    const std::string& value = argv[++i];
    if (flag == "--preset") {
    } else if (flag == "--tokens") {
      a.problem.num_tokens = parse_int(flag, value);
    } else if (flag == "--hidden") {
      a.problem.hidden_size = parse_int(flag, value);
    } else if (flag == "--intermediate") {
      a.problem.intermediate_size = parse_int(flag, value);
    } else if (flag == "--experts") {
      a.problem.num_experts = parse_int(flag, value);
    } else if (flag == "--topk") {
      a.problem.topk = parse_int(flag, value);
    } else if (flag == "--shared") {
      a.problem.shared_intermediate_size = parse_int(flag, value);
    } else if (flag == "--ep-size") {
      const std::int64_t n = parse_int(flag, value);
      if (n < 1 || n > 1024) throw UsageError("--ep-size: expected 1..1024, got " + value);
      a.problem.ep_size = static_cast<int>(n);
    } else if (flag == "--minibatch") {
      a.config.minibatch_size = parse_int(flag, value);
    } else if (flag == "--macrobatch") {
      a.config.macrobatch_size = parse_int(flag, value);
    } else if (flag == "--forward") {
      if (value == "launches")
        a.config.forward_path = ForwardPath::launches;
      else if (value == "fused")
        a.config.forward_path = ForwardPath::fused;
      else
        throw UsageError("--forward: expected launches or fused, got '" + value + "'");
    } else if (flag == "--precision") {
      if (value == "bf16")
        a.precision = Precision::bf16;
      else if (value == "fp8")
        a.precision = Precision::fp8;
      else if (value == "fp8-bf16-wgrad")
        a.precision = Precision::fp8_bf16_wgrad;
      else
        throw UsageError("--precision: expected bf16, fp8 or fp8-bf16-wgrad, got '" + value + "'");
    } else if (flag == "--check") {
      if (value == "auto")
        a.check = CheckSize::automatic;
      else if (value == "full")
        a.check = CheckSize::full;
      else if (value == "sampled")
        a.check = CheckSize::sampled;
      else
        throw UsageError("--check: expected auto, full or sampled, got '" + value + "'");
    } else if (flag == "--stage-rows") {
      a.config.fused_stage_rows = parse_int(flag, value);
    } else if (flag == "--swiglu-limit") {
      char* end = nullptr;
      const double l = std::strtod(value.c_str(), &end);
      const auto f = static_cast<float>(l);
      if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(f) || !(f > 0)) {
        throw UsageError("--swiglu-limit: expected a finite positive number, got '" + value + "'");
      }
      a.swiglu_limit = f;
    } else if (flag == "--seed") {
      a.seed = static_cast<std::uint64_t>(parse_int(flag, value));
    } else if (flag == "--threads") {
      const std::int64_t n = parse_int(flag, value);
      if (n < 1 || n > 4096) throw UsageError("--threads: expected 1..4096, got " + value);
      a.threads = static_cast<int>(n);
    } else if (flag == "--backend") {
      if (value == "auto")
        a.backend = Backend::automatic;
      else if (value == "cpu")
        a.backend = Backend::cpu;
      else if (value == "cuda")
        a.backend = Backend::cuda;
      else
        throw UsageError("--backend: expected auto, cpu or cuda, got '" + value + "'");
    } else if (flag == "--routing") {
      if (value == "uniform")
        a.routing = Routing::softmax;
      else if (value == "skewed")
        a.routing = Routing::skewed;
      else if (value == "one-expert")
        a.routing = Routing::one_expert;
      else
        throw UsageError("--routing: expected uniform, skewed or one-expert, got '" + value + "'");
    } else {
      throw UsageError("unknown option '" + flag + "' (see mok --help)");
    }
  }
  return a;
}

}  // namespace

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::bf16:
      return "bf16";
    case Precision::fp8:
      return "fp8";
    case Precision::fp8_bf16_wgrad:
      return "fp8-bf16-wgrad";
  }
  return "?";
}

bool is_fp8(Precision p) {
  return p != Precision::bf16;
}

BackwardOptions backward_options(Precision p) {
  BackwardOptions o;
  o.fp8_weight_grads = p != Precision::fp8_bf16_wgrad;
  return o;
}

const Preset* find_preset(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

std::string preset_list() {
  std::string s;
  for (const Preset& p : kPresets) s += (s.empty() ? "" : ", ") + std::string(p.name);
  return s;
}

}  // namespace mok::cli

int main(int argc, char** argv) {
  using namespace mok::cli;
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::printf(kHelp, mok::kVersion, preset_list().c_str());
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version") {
    std::printf("mok %s\n", mok::kVersion);
    return 0;
  }
  try {
    if (args[0] != "run") throw UsageError("unknown command '" + args[0] + "' (see mok --help)");
    args.erase(args.begin());
    for (const auto& a : args) {
      if (a == "--help" || a == "-h") {
        std::printf(kHelp, mok::kVersion, preset_list().c_str());
        return 0;
      }
    }
    const RunArgs run_args = parse_run(args);
    return run_args.plan ? print_plan(run_args) : run(run_args);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "mok: %s\n", e.what());
    return 2;
  } catch (const mok::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mok: internal error: %s\n", e.what());
    return 3;
  }
}
