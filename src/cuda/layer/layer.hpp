// The whole layer on the GPU as a sequence of launches (the unfused path; docs/architecture.md,
// "One forward call" and "One backward call"): schedule -> per ring pass: dispatch, gate/up +
// SwiGLU GEMM, down GEMM whose epilogue is the combine (rows stored into their home slots) -> home
// reduction; backward: dispatch of d_out, down dgrad, SwiGLU backward, gate/up dgrad whose
// epilogue is the combine of d_x, the three routed weight gradients; the shared expert through
// the dense forms.
//
// It runs every rank of a local virtual team (W ranks on one GPU; docs/architecture.md, "Expert
// parallelism"; W = 1 is the single-GPU layer behind mok::forward / mok::backward), or one rank of
// a team across processes (ExternalRank), whose peers' rows move through their symmetric regions
// at system scope, ordered by team barriers. Launches only enqueue work on the given stream: no
// host synchronization, no allocation after construction, so a whole step can be captured in a
// CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mok/api.hpp"

namespace mok::cuda {

struct FusedForwardParams;  // kernels/fused_forward.hpp
// A launcher with kernels/fused_forward.hpp's launch_fused_forward contract: the library's, or
// the hooked one tests/cpp builds (which honours FusedForwardParams' withhold_block and trace).
using FusedLauncher = void (*)(const FusedForwardParams& p, bool clamped, cudaStream_t stream);

// One rank's tensors for a call (CUDA views; `out`, `d_out` and `grads` only where the call uses
// them). `ctx` is the rank's forward context: forward writes it, backward reads it. With `q`, the
// FP8 layer (docs/architecture.md, "The FP8 layer"): the routed GEMMs run on these quantized
// weights and `w`'s routed views are not read; every rank of a call alike.
struct RankTensors {
  Inputs in;
  Weights w;
  TensorView out;
  TensorView d_out;
  Grads grads;
  ForwardContext ctx;
  const Fp8Weights* q = nullptr;
};

// This process's one rank of a team across processes: every rank's symmetric region (ep_size
// entries, symmetric_workspace_bytes() each, [ep_rank] its own; e.g. PyTorch symmetric memory)
// and the bound on every device-side wait for a peer. Empty bases: a local virtual team.
struct ExternalRank {
  std::vector<void*> symmetric_bases;
  std::uint64_t barrier_timeout_ms = 10000;
};

class Layer {
 public:
  // `p.ep_size` ranks, all in this process on `device` (a local virtual team); or, with
  // `external.symmetric_bases`, rank p.ep_rank of a team whose other ranks are other processes.
  // Every rank of an external team must construct its layer before any rank calls it (a host
  // barrier between construction and the first call: the team's flags start at zero). `fp8`:
  // also hold the FP8 layer's scratch (plan::Fp8Plan; H and I multiples of 128), without which a
  // call with RankTensors::q throws mok::Error; `fp8_token_axis` false: without its token-axis
  // copies, so that only a backward with bf16 weight gradients (BackwardOptions::
  // fp8_weight_grads false) can run (another throws mok::Error).
  Layer(const Problem& p, const Config& config, int device, const ExternalRank& external = {},
        bool fp8 = false, bool fp8_token_axis = true);
  ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  // Calls on different streams are ordered on the device: each waits for the previous call's work
  // (an event; not inside a stream capture, where the graph orders them).
  // `ranks`: one entry per rank this process runs (all W, or the one external rank).
  // Every rank's forward (`write_output` false: recompute_forward_context, which writes the same
  // context, the first ring pass's gate/up only, without the down projection or `out`).
  void forward(std::span<const RankTensors> ranks, bool write_output, cudaStream_t stream);
  void backward(std::span<const RankTensors> ranks, const BackwardOptions& options,
                cudaStream_t stream);

  // Raises a device-side error (a bad expert id, a timed-out wait) reported so far; the
  // device-side clear of the record is ordered on `stream`.
  void check_errors(cudaStream_t stream = nullptr);

  // The forward path (Config::forward_path when the layer is made; tests and benchmarks compare
  // both on one layer). Throws mok::Error for the fused path on a team across processes.
  ForwardPath forward_path() const;
  void set_forward_path(ForwardPath path);
  // Tests and benchmarks only: the forward megakernel's hooks. The library's kernel has none of
  // their code; a launcher built with them (tests/cpp/support/kernel_hooks.hpp) must be given.
  struct ForwardHooks {
    // The megakernel never pulls ring rows [128 b, 128 b + 128) of a pass (-1: off), so the
    // gate/up tiles of those rows wait until the timeout and the call's outputs are void.
    int withheld_block = -1;
    std::uint64_t timeout_ms = 0;  // the megakernel's waits (0: the team's barrier timeout)
    // The launch of the first rank's pass 0 writes its trace (kernels/fused_forward.hpp:
    // globaltimer stamps per CTA and per ticket) into `trace_words` u64 words of device memory
    // at `trace` (null: off); tickets past what fits are not traced.
    std::uint64_t* trace = nullptr;
    std::int64_t trace_words = 0;
    FusedLauncher launcher = nullptr;  // null: the library's (no hooks)
    // A team across processes takes the fused forward, which set_forward_path refuses it until a
    // run on several GPUs has tested it: the test that decides (LayerGpuExpertParallel.
    // RanksOnSeveralGpusGiveTheSingleGpuBits) sets this before switching its layers to it.
    bool untested_team = false;
  };
  // Throws when the trace cannot hold the header and one set of per-CTA words
  // (forward_trace_words(0)), or a hook is asked for without a launcher.
  void set_forward_hooks(const ForwardHooks& hooks);
  // Words of a trace with room for `tickets` tickets on this device's grid.
  static std::int64_t forward_trace_words(std::int64_t tickets);

  // The FP8 layer's kernel choices, each giving the same bits as the others (tests compare them
  // bitwise, benchmarks time them on one layer); the defaults are what measured fastest, the rest
  // off (layer.cu says why, NOTES.md gives the numbers):
  struct Fp8Kernels {
    // The M-grouped e4m3 GEMMs' K loop with the next K block's wgmma in flight during a
    // promotion (the launchers' `overlap`; not with `wide`).
    bool overlap = false;
    // The same for the weight gradients' K loop (WeightGradFp8Args::overlap).
    bool wgrad_overlap = true;
    // The weight gradients' bf16 tiles through shared memory and TMA (WeightGradFp8Args::
    // tma_store).
    bool wgrad_tma_store = true;
    // The M-grouped e4m3 GEMMs on 128 x 256 tiles where n fills whole ones (the launchers'
    // `wide`), else 128 x 128.
    bool wide = true;
    // The down dgrad's epilogue writes dg and du quantized for the GEMMs that read them
    // (RowsTimesWeightFp8Args::quantized) instead of bf16 dg and du and four passes over them.
    bool quantizing_epilogue = false;
    // The token-axis quantizations (the weight gradients' operands) with whole-row loads and a
    // transposition in shared memory (QuantizePassTokenAxisParams::row_loads), else 32-byte
    // pieces of 32 rows a warp.
    bool token_axis_row_loads = true;
    // The gate/up epilogue writes q(h) for the down GEMM beside h (GateUpForwardFp8Args::
    // hidden_quantized), instead of a pass over h; with `wide` only (else the pass).
    bool hidden_epilogue = true;
    // The down dgrad's epilogue writes q(dg) and q(du) for the gate/up dgrad beside the bf16 dg
    // and du (RowsTimesWeightFp8Args::quantized, the rows forms), instead of two passes over
    // them. Not with quantizing_epilogue, which takes precedence where both apply.
    bool dgrad_rows_epilogue = true;
    // The down dgrad with that rows epilogue on wide tiles where `wide` allows, else on 128 x 128
    // ones (the same bits).
    bool dgrad_rows_wide = false;
  };
  Fp8Kernels fp8_kernels() const;
  // Throws mok::Error naming fp8_kernels.wide when asked for both `wide` and `overlap`.
  void set_fp8_kernels(const Fp8Kernels& kernels);

  std::int64_t ring_rows() const;  // rows of a pass: the forward context's routed rows
  int max_passes() const;
  bool has_fp8() const;  // made with `fp8`
  std::size_t bytes() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mok::cuda
