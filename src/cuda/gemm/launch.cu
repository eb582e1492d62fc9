// The grouped GEMM launchers (grouped_gemm.hpp): argument checks, tensor maps and the GEMM's
// descriptor (descriptor.cuh), the choice of epilogue policy, and the wait-timeout reports. Host
// code only: the kernel and its instantiations are in src/cuda/kernels/sm90_bf16_grouped_gemm.cu
// (launch.hpp between the two).
#include "cuda/gemm/launch.hpp"

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

#include "cuda/gemm/config.hpp"
#include "cuda/gemm/descriptor.cuh"
#include "cuda/gemm/epilogue.cuh"
#include "cuda/gemm/forms.cuh"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/tensor_map.hpp"
#include "mok/error.hpp"

namespace mok::gemm {

int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("grouped GEMM: cannot query the current CUDA device");
  }
  return device;
}

namespace {

int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

void check(bool ok, const std::string& argument, const std::string& expected,
           const std::string& actual) {
  if (!ok) throw Error(argument, expected, actual);
}

void check_aligned(const void* ptr, const char* name) {
  check(reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0, name, "16-byte alignment", to_text(ptr));
}

// A clamped SwiGLU epilogue's limit: absent, or finite and positive (mok::Error names the value).
void check_swiglu_limit(const std::optional<float>& limit, const char* name) {
  if (!limit) return;
  check(std::isfinite(*limit) && *limit > 0.0f, name, "a finite positive number", to_text(*limit));
}

void check_multiple_of_64(int v, const char* name) {
  check(v > 0 && v % 64 == 0, name, "a positive multiple of 64", to_text(v));
}

// A weight operand's tensor map geometry (WeightStrides): leading dimension, rows per group of
// the map, and the map's row count, for G groups of `rows` x `cols`.
struct WeightMap {
  std::int64_t ld, rows_per_group, map_rows;
};
WeightMap weight_map(const WeightStrides& w, int groups, std::int64_t rows, std::int64_t cols) {
  const std::int64_t ld = w.ld != 0 ? w.ld : cols;
  const std::int64_t group_stride = w.group_stride != 0 ? w.group_stride : rows * ld;
  check(ld % 8 == 0 && ld >= cols, "w_strides.ld", "0 or a multiple of 8 >= " + to_text(cols),
        to_text(ld));
  check(group_stride % ld == 0 && group_stride / ld >= rows, "w_strides.group_stride",
        "0 or a multiple of ld that leaves " + to_text(rows) + " rows per group",
        to_text(group_stride));
  const std::int64_t per_group = group_stride / ld;
  return {ld, per_group, (groups - 1) * per_group + rows};
}

void check_segments(const RowSegments& s) {
  check(s.num_groups >= 1 && s.num_groups <= kMaxGroups, "segments.num_groups",
        "in [1, " + to_text(kMaxGroups) + "]", to_text(s.num_groups));
  check(s.capacity_rows >= 0, "segments.capacity_rows", ">= 0", to_text(s.capacity_rows));
  check((s.starts == nullptr) == (s.rows == nullptr), "segments.starts/rows",
        "both device pointers or both null (dense)", "one of them null");
  if (s.starts == nullptr) {
    check(s.num_groups == 1, "segments.num_groups", "1 for the dense form", to_text(s.num_groups));
    check(s.dense_rows >= 0 && s.dense_rows <= s.capacity_rows, "segments.dense_rows",
          "in [0, capacity_rows]", to_text(s.dense_rows));
  }
}

// Output checks of the M-grouped plain forms: `out`, or a row scatter in its place.
void set_output(GemmParams& p, __nv_bfloat16* out, long long ld_out, int n,
                const RowScatter& scatter) {
  check(ld_out % 8 == 0 && ld_out >= n, "ld_out", "a multiple of 8 and >= n", to_text(ld_out));
  if (scatter.rows == nullptr) {
    check(out != nullptr, "out", "a device pointer", "null");
    check_aligned(out, "out");
  } else {
    check(scatter.peers != nullptr, "scatter.peers", "a device array of destinations", "null");
    check(scatter.slots > 0 && scatter.slots <= 0x7fffffff, "scatter.slots", "in [1, 2^31)",
          to_text(scatter.slots));
    check(ld_out % 8 == 0, "ld_out", "a multiple of 8 (16-byte rows at every slot)",
          to_text(ld_out));
  }
  p.out = out;
  p.ld_out = ld_out;
  p.scatter_rows = scatter.rows;
  p.scatter_slots = static_cast<unsigned>(scatter.slots);
  p.scatter_peers = scatter.peers;
}

SchedulerParams scheduler_params(const RowSegments& s, int m_tiles, int n_tiles, int k_blocks) {
  return SchedulerParams{s.starts,     s.rows,  s.num_groups, s.capacity_rows,
                         s.dense_rows, m_tiles, n_tiles,      k_blocks};
}

// A descriptor with the group tables and the waits set; the maps are the form's to set.
GemmDescriptor base_descriptor(const RowSegments& s, const WaitOptions& waits) {
  check(waits.timeout_ns > 0, "waits.timeout_ns", "> 0 nanoseconds", to_text(waits.timeout_ns));
  GemmDescriptor d{};
  GemmParams& p = d.p;
  p.sched = scheduler_params(s, 0, 0, 0);
  p.wait_timeout_ns = waits.timeout_ns;
  p.timeout_report = waits.report != nullptr ? waits.report->report() : nullptr;
  p.timeout_lock = waits.report != nullptr ? waits.report->lock() : nullptr;
  return d;
}

// A report's text ("" if no wait gave up).
std::string report_text(const volatile WaitTimeoutReport* r, int device) {
  if (r->timed_out == 0) return {};
  const char* const names[] = {"full", "empty", "tile queue full", "tile queue empty"};
  const int id = r->barrier_id;
  return "grouped GEMM gave up on device " + to_text(device) + ": barrier " +
         (id >= 0 && id < 4 ? names[id] : "?") + " (shared offset " + to_text(r->smem_address) +
         ", parity " + to_text(r->parity) + ") waited past " + to_text(r->timeout_ns / 1000000ull) +
         " ms in block " + to_text(r->block) + ", thread " + to_text(r->thread);
}

}  // namespace

// NOTES: portable, so the host memory is mapped in every device's context; with unified
// addressing (every sm_90 system) the host pointer is the device pointer.
TimeoutReport::TimeoutReport(unsigned* lock)
    : lock_(lock), own_lock_(lock == nullptr), device_(current_device()) {
  void* h = nullptr;
  cudaError_t e =
      cudaHostAlloc(&h, sizeof(WaitTimeoutReport), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) {
    std::memset(h, 0, sizeof(WaitTimeoutReport));
    report_ = static_cast<WaitTimeoutReport*>(h);
    if (own_lock_) e = cudaMalloc(&lock_, sizeof(unsigned));
  }
  if (e == cudaSuccess && own_lock_) e = cudaMemset(lock_, 0, sizeof(unsigned));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    cudaFreeHost(report_);
    if (own_lock_) cudaFree(lock_);
    throw Error("grouped GEMM timeout report", "mapped host memory and a device word",
                cudaGetErrorString(e));
  }
}

TimeoutReport::~TimeoutReport() {
  cudaFreeHost(report_);
  if (own_lock_) cudaFree(lock_);
}

std::string TimeoutReport::take() {
  volatile WaitTimeoutReport* r = report_;
  std::string text = report_text(r, device_);
  if (!text.empty()) r->timed_out = 0;
  return text;
}

std::string TimeoutReport::peek() const {
  return report_text(report_, device_);
}

int persistent_grid_size() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    throw Error("cannot query the multiprocessor count of the current device");
  }
  return sms;
}

namespace {

// body(std::true_type{}) or body(std::false_type{}): a launch-level option as a compile-time one.
template <class Body>
void with_flag(bool on, Body&& body) {
  if (on) {
    body(std::true_type{});
  } else {
    body(std::false_type{});
  }
}

// The gate/up forms' outputs (bf16 and e4m3 arguments alike): hidden, the optional
// pre-activations (both or neither), their leading dimension, the clamp.
template <class Args>
void check_gate_up_outputs(const Args& args) {
  check((args.gate == nullptr) == (args.up == nullptr), "gate/up outputs", "both or neither",
        "one of them null");
  check(args.hidden != nullptr, "hidden", "a device pointer", "null");
  check_aligned(args.hidden, "hidden");
  check_aligned(args.gate, "gate");
  check_aligned(args.up, "up");
  check(args.ld_out % 8 == 0 && args.ld_out >= args.intermediate_size, "ld_out",
        "a multiple of 8 and >= intermediate_size", to_text(args.ld_out));
  check_swiglu_limit(args.swiglu_limit, "swiglu_limit");
}

// Form F with epilogue policy E over `d`.
template <class F, class E>
void launch(const GemmDescriptor& d, cudaStream_t stream, const Fp8Params& fp8 = {}) {
  launch_grouped_gemm<F, E>(d, stream, fp8);
}

// An output an epilogue writes in the rows form (1x128 blocks along its n columns, 8-byte stores
// of a row's pieces, a block's scale at [block][row]): mok::Error naming `name`.
void check_rows_out(const Fp8Out& o, std::int64_t n, std::int64_t rows, const std::string& name) {
  check(o.data != nullptr && reinterpret_cast<std::uintptr_t>(o.data) % 8 == 0, name + ".data",
        "a device pointer with 8-byte alignment", to_text(static_cast<const void*>(o.data)));
  check(o.scale != nullptr && reinterpret_cast<std::uintptr_t>(o.scale) % 4 == 0, name + ".scale",
        "a device pointer with 4-byte alignment", to_text(o.scale));
  check(o.ld >= n && o.ld % 8 == 0, name + ".ld", "a multiple of 8 and >= n (" + to_text(n) + ")",
        to_text(o.ld));
  check(o.scale_ld >= rows, name + ".scale_ld", ">= segments.capacity_rows (" + to_text(rows) + ")",
        to_text(o.scale_ld));
}

}  // namespace

template <class F>
std::optional<GemmDescriptor> describe_gate_up_forward(const GateUpForwardArgs& args) {
  check_segments(args.segments);
  check_multiple_of_64(args.hidden_size, "hidden_size");
  check_multiple_of_64(args.intermediate_size, "intermediate_size");
  check_gate_up_outputs(args);
  const RowSegments& s = args.segments;
  if (s.capacity_rows == 0) return std::nullopt;
  const WeightMap w =
      weight_map(args.w_strides, s.num_groups, args.intermediate_size, args.hidden_size);
  const CUtensorMap a =
      make_tensor_map_bf16(args.x, s.capacity_rows, args.hidden_size, args.ld_x, F::kBoxRowsA, "x");
  const CUtensorMap bg =
      make_tensor_map_bf16(args.w_gate, w.map_rows, args.hidden_size, w.ld, F::kBoxRowsB, "w_gate");
  const CUtensorMap bu =
      make_tensor_map_bf16(args.w_up, w.map_rows, args.hidden_size, w.ld, F::kBoxRowsB, "w_up");
  GemmDescriptor d = base_descriptor(s, args.waits);
  d.a = d.a2 = d.out = a;
  d.b = bg;
  d.b2 = bu;
  GemmParams& p = d.p;
  p.sched.n_tiles = ceil_div(args.intermediate_size, F::kOutTileN);
  p.sched.k_blocks = args.hidden_size / kTileK;
  p.n = args.intermediate_size;
  p.b_rows_per_group = static_cast<int>(w.rows_per_group);
  p.out = args.hidden;
  p.ld_out = args.ld_out;
  p.gate_out = args.gate;
  p.up_out = args.up;
  p.swiglu_limit = args.swiglu_limit.value_or(0.0f);
  return d;
}

template <class F>
std::optional<GemmDescriptor> describe_rows_times_weight_t(const RowsTimesWeightTArgs& args) {
  check_segments(args.segments);
  check_multiple_of_64(args.n, "n");
  check_multiple_of_64(args.k, "k");
  const RowSegments& s = args.segments;
  if (s.capacity_rows == 0) return std::nullopt;
  const CUtensorMap a =
      make_tensor_map_bf16(args.a, s.capacity_rows, args.k, args.ld_a, F::kBoxRowsA, "a");
  const CUtensorMap b = make_tensor_map_bf16(args.w, static_cast<long long>(s.num_groups) * args.n,
                                             args.k, args.k, F::kBoxRowsB, "w");
  GemmDescriptor d = base_descriptor(s, args.waits);
  d.a = d.a2 = d.out = a;
  d.b = d.b2 = b;
  GemmParams& p = d.p;
  p.sched.n_tiles = ceil_div(args.n, F::kOutTileN);
  p.sched.k_blocks = args.k / kTileK;
  p.n = args.n;
  p.b_rows_per_group = args.n;
  set_output(p, args.out, args.ld_out, args.n, args.scatter);
  p.row_scale = args.row_scale;
  return d;
}

namespace {

template <class F>
void gate_up_forward_form(const GateUpForwardArgs& args) {
  const std::optional<GemmDescriptor> d = describe_gate_up_forward<F>(args);
  if (!d) return;
  with_flag(args.gate != nullptr, [&](auto pre_activations) {
    with_flag(args.swiglu_limit.has_value(), [&](auto clamped) {
      launch<F, epilogue::SwigluForward<pre_activations(), clamped()>>(*d, args.stream);
    });
  });
}

template <class F>
void rows_times_weight_t_form(const RowsTimesWeightTArgs& args) {
  const std::optional<GemmDescriptor> d = describe_rows_times_weight_t<F>(args);
  if (!d) return;
  with_flag(args.row_scale != nullptr, [&](auto scaled) {
    with_flag(args.scatter.rows != nullptr, [&](auto scattered) {
      launch<F, epilogue::RowsBf16<scaled(), scattered()>>(*d, args.stream);
    });
  });
}

}  // namespace

namespace {

void check_multiple_of_128(int v, const char* name) {
  check(v > 0 && v % 128 == 0, name, "a positive multiple of 128 (e4m3: 128 x 128 weight blocks)",
        to_text(v));
}

// An e4m3 row operand over `rows` rows of `k` columns: its map and its scales' checks.
CUtensorMap fp8_rows_map(const Fp8Rows& r, int rows, int k, int box_rows, const std::string& name) {
  check(r.scale != nullptr, name + ".scale", "a device pointer", "null");
  // A tile's scales of one K block are one bulk copy (mainloop.cuh, load_k_block): 16-byte aligned.
  check(reinterpret_cast<std::uintptr_t>(r.scale) % 16 == 0, name + ".scale", "16-byte alignment",
        to_text(r.scale));
  check(r.scale_ld >= rows && r.scale_ld % 4 == 0, name + ".scale_ld",
        "a multiple of 4 >= capacity_rows (" + to_text(rows) + ")", to_text(r.scale_ld));
  return make_tensor_map_e4m3(r.data, rows, k, r.ld, box_rows, name.c_str());
}

// An e4m3 weight [groups, n, k]: its map and its scales' checks.
CUtensorMap fp8_weight_map(const Fp8Weight& w, int groups, int n, int k, int box_rows,
                           const std::string& name) {
  check(w.scale != nullptr, name + ".scale", "a device pointer", "null");
  check(reinterpret_cast<std::uintptr_t>(w.scale) % 4 == 0, name + ".scale", "4-byte alignment",
        to_text(w.scale));
  return make_tensor_map_e4m3(w.data, static_cast<long long>(groups) * n, k, k, box_rows,
                              (name + ".data").c_str());
}

template <bool kPair, bool kOverlap = false, bool kWide = false>
using Fp8GateUp = Form<FormKind::kGateUp, Operand::e4m3, kPair, kOverlap, false, kWide>;
template <bool kPair, bool kOverlap = false, bool kWide = false>
using Fp8RowsWT = Form<FormKind::kRowsWT, Operand::e4m3, kPair, kOverlap, false, kWide>;

// The M-grouped e4m3 launchers' mainloop options: body(form) with std::type_identity<Form> of the
// one they pick (`wide` alone, or pairs and overlap in any combination), made from Form<pairs,
// overlap, wide>. A wide tile with pairs or the overlap is refused, naming `wide`.
template <template <bool, bool, bool> class Form3, class Body>
void with_mainloop(bool pairs, bool overlap, bool wide, Body&& body) {
  if (wide) {
    check(!pairs && !overlap, "wide", "alone (wide tiles run without pairs and the overlap)",
          std::string("with") + (pairs ? " pairs" : "") + (overlap ? " overlap" : ""));
    body(std::type_identity<Form3<false, false, true>>{});
    return;
  }
  with_flag(pairs, [&](auto p) {
    with_flag(overlap, [&](auto o) { body(std::type_identity<Form3<p(), o(), false>>{}); });
  });
}

template <template <bool, bool, bool> class Form3, class Body>
void with_mainloop_geometry(bool wide, Body&& body) {
  // Pairs and the overlap keep the plain tile's geometry; a wide tile has its own.
  with_flag(wide, [&](auto w) { body(std::type_identity<Form3<false, false, w()>>{}); });
}

template <class F>
void gate_up_forward_fp8_launch(const GateUpForwardFp8Args& args);
template <class F>
void rows_times_weight_t_fp8_launch(const RowsTimesWeightTFp8Args& args);
template <class F>
void rows_times_weight_fp8_launch(const RowsTimesWeightFp8Args& args);

}  // namespace

void gate_up_forward_fp8(const GateUpForwardFp8Args& args) {
  with_mainloop_geometry<Fp8GateUp>(args.wide, [&](auto geometry) {
    gate_up_forward_fp8_launch<typename decltype(geometry)::type>(args);
  });
}

void rows_times_weight_t_fp8(const RowsTimesWeightTFp8Args& args) {
  with_mainloop_geometry<Fp8RowsWT>(args.wide, [&](auto geometry) {
    rows_times_weight_t_fp8_launch<typename decltype(geometry)::type>(args);
  });
}

void rows_times_weight_fp8(const RowsTimesWeightFp8Args& args) {
  with_mainloop_geometry<Fp8RowsWT>(args.wide, [&](auto geometry) {
    rows_times_weight_fp8_launch<typename decltype(geometry)::type>(args);
  });
}

namespace {

// F: the launch's tile geometry (the plain form, or the wide one).
template <class F>
void gate_up_forward_fp8_launch(const GateUpForwardFp8Args& args) {
  check_segments(args.segments);
  check_multiple_of_128(args.hidden_size, "hidden_size");
  check_multiple_of_128(args.intermediate_size, "intermediate_size");
  check_gate_up_outputs(args);
  const RowSegments& s = args.segments;
  if (args.hidden_quantized.data != nullptr) {
    check(args.wide && !args.pairs && !args.overlap, "hidden_quantized",
          "null without `wide` alone (128 x 256 tiles: a tile's 128 columns of hidden are one "
          "1x128 block of each row)",
          std::string("set with") + (args.wide ? " wide" : "out wide") +
              (args.pairs ? " and pairs" : "") + (args.overlap ? " and overlap" : ""));
    check_rows_out(args.hidden_quantized, args.intermediate_size, s.capacity_rows,
                   "hidden_quantized");
  }
  if (s.capacity_rows == 0) return;
  const int G = s.num_groups, N = args.intermediate_size, K = args.hidden_size;
  const CUtensorMap a = fp8_rows_map(args.x, s.capacity_rows, K, F::kBoxRowsA, "x");
  GemmDescriptor d = base_descriptor(s, args.waits);
  d.a = d.a2 = d.out = a;
  d.b = fp8_weight_map(args.w_gate, G, N, K, F::kBoxRowsB, "w_gate");
  d.b2 = fp8_weight_map(args.w_up, G, N, K, F::kBoxRowsB, "w_up");
  GemmParams& p = d.p;
  p.sched.n_tiles = ceil_div(N, F::kOutTileN);
  p.sched.k_blocks = K / F::kBlockK;
  p.n = N;
  p.b_rows_per_group = N;
  p.out = args.hidden;
  p.ld_out = args.ld_out;
  p.gate_out = args.gate;
  p.up_out = args.up;
  p.swiglu_limit = args.swiglu_limit.value_or(0.0f);
  Fp8Params fp8{args.x.scale,    nullptr, args.x.scale_ld, args.w_gate.scale,
                args.w_up.scale, N / 128, K / F::kBlockK};
  if (args.hidden_quantized.data != nullptr) {
    if constexpr (F::kWideTile) {
      fp8.q_rows[0] = args.hidden_quantized.data;
      fp8.q_rows_scales[0] = args.hidden_quantized.scale;
      fp8.q_rows_ld = args.hidden_quantized.ld;
      fp8.q_rows_scale_ld = args.hidden_quantized.scale_ld;
      with_flag(args.gate != nullptr, [&](auto pre_activations) {
        with_flag(args.swiglu_limit.has_value(), [&](auto clamped) {
          launch<F, epilogue::SwigluForward<pre_activations(), clamped(), true>>(d, args.stream,
                                                                                 fp8);
        });
      });
      return;
    }
  }
  with_mainloop<Fp8GateUp>(args.pairs, args.overlap, args.wide, [&](auto form) {
    using L = typename decltype(form)::type;
    with_flag(args.gate != nullptr, [&](auto pre_activations) {
      with_flag(args.swiglu_limit.has_value(), [&](auto clamped) {
        launch<L, epilogue::SwigluForward<pre_activations(), clamped()>>(d, args.stream, fp8);
      });
    });
  });
}

// A wide tile's two 128-column halves each read their own weight block (mainloop.cuh,
// load_k_block): n must fill whole tiles.
template <class F>
void check_wide_n(int n, const char* name) {
  if constexpr (F::kWideTile) {
    check(n % F::kTileN == 0, name, "a multiple of 256 with `wide` (128 x 256 tiles)", to_text(n));
  }
}

template <class F>
void rows_times_weight_t_fp8_launch(const RowsTimesWeightTFp8Args& args) {
  check_segments(args.segments);
  check_multiple_of_128(args.n, "n");
  check_multiple_of_128(args.k, "k");
  check_wide_n<F>(args.n, "n");
  const RowSegments& s = args.segments;
  if (s.capacity_rows == 0) return;
  const CUtensorMap a = fp8_rows_map(args.a, s.capacity_rows, args.k, F::kBoxRowsA, "a");
  GemmDescriptor d = base_descriptor(s, args.waits);
  d.a = d.a2 = d.out = a;
  d.b = d.b2 = fp8_weight_map(args.w, s.num_groups, args.n, args.k, F::kBoxRowsB, "w");
  GemmParams& p = d.p;
  p.sched.n_tiles = ceil_div(args.n, F::kOutTileN);
  p.sched.k_blocks = args.k / F::kBlockK;
  p.n = args.n;
  p.b_rows_per_group = args.n;
  set_output(p, args.out, args.ld_out, args.n, args.scatter);
  p.row_scale = args.row_scale;
  const Fp8Params fp8{args.a.scale, nullptr,      args.a.scale_ld,    args.w.scale,
                      args.w.scale, args.n / 128, args.k / F::kBlockK};
  with_mainloop<Fp8RowsWT>(args.pairs, args.overlap, args.wide, [&](auto form) {
    using L = typename decltype(form)::type;
    with_flag(args.row_scale != nullptr, [&](auto scaled) {
      with_flag(args.scatter.rows != nullptr, [&](auto scattered) {
        launch<L, epilogue::RowsBf16<scaled(), scattered()>>(d, args.stream, fp8);
      });
    });
  });
}

}  // namespace

namespace {

// The input-gradient forms' epilogue choices (RowsTimesWeightArgs and RowsTimesWeightFp8Args): the
// SwiGLU backward (all four of gate, up, d_gate, d_up, with its options), fp32 rows, or bf16 rows
// (optionally scattered). Checks them, naming the argument.
void check_input_gradient_epilogue(const SwigluBackwardEpilogue& sw) {
  const bool swiglu = sw.d_gate != nullptr;
  check(swiglu == (sw.gate != nullptr) && swiglu == (sw.up != nullptr) &&
            swiglu == (sw.d_up != nullptr),
        "swiglu", "all four of gate, up, d_gate, d_up device pointers, or all null",
        "some of them null");
  if (!swiglu) {
    check(sw.row_scale == nullptr, "swiglu.row_scale",
          "null without the SwiGLU epilogue (gate, up, d_gate, d_up)", to_text(sw.row_scale));
    check(sw.dot == nullptr, "swiglu.dot",
          "null without the SwiGLU epilogue (gate, up, d_gate, d_up)", to_text(sw.dot));
  }
  check(sw.scaled_hidden == nullptr || (sw.row_scale != nullptr && sw.dot != nullptr),
        "swiglu.scaled_hidden", "null without both swiglu.row_scale and swiglu.dot",
        to_text(sw.scaled_hidden));
}

// The outputs of an input-gradient form into `p` (after check_input_gradient_epilogue).
void set_input_gradient_outputs(GemmParams& p, const SwigluBackwardEpilogue& sw, void* out,
                                std::int64_t ld_out, bool out_fp32, const RowScatter& scatter,
                                int n) {
  // gate is set exactly when d_gate is (check_input_gradient_epilogue), except with quantized
  // outputs, where dg and du in bf16 are optional (check_quantized_swiglu).
  if (sw.gate != nullptr) {
    check(scatter.rows == nullptr, "swiglu", "no row scatter with it", "scatter.rows set");
    check(!out_fp32, "out_fp32", "false with the SwiGLU epilogue (dg and du are bf16)", "true");
    check(ld_out % 8 == 0 && ld_out >= n, "ld_out", "a multiple of 8 and >= n", to_text(ld_out));
    check_aligned(sw.gate, "swiglu.gate");
    check_aligned(sw.up, "swiglu.up");
    check_aligned(sw.d_gate, "swiglu.d_gate");
    check_aligned(sw.d_up, "swiglu.d_up");
    check(reinterpret_cast<std::uintptr_t>(sw.row_scale) % 4 == 0, "swiglu.row_scale",
          "4-byte alignment", to_text(sw.row_scale));
    check(reinterpret_cast<std::uintptr_t>(sw.dot) % 4 == 0, "swiglu.dot", "4-byte alignment",
          to_text(sw.dot));
    if (sw.scaled_hidden != nullptr) check_aligned(sw.scaled_hidden, "swiglu.scaled_hidden");
    p.ld_out = ld_out;
    p.swiglu_gate = sw.gate;
    p.swiglu_up = sw.up;
    p.d_gate = sw.d_gate;
    p.d_up = sw.d_up;
    p.row_scale = sw.row_scale;
    p.swiglu_dot = sw.dot;
    p.scaled_hidden = sw.scaled_hidden;
    check_swiglu_limit(sw.limit, "swiglu.limit");
    p.swiglu_limit = sw.limit.value_or(0.0f);
  } else if (out_fp32) {
    check(scatter.rows == nullptr, "scatter.rows", "null with out_fp32 (a scatter stores bf16)",
          "set");
    check(out != nullptr, "out", "a device pointer", "null");
    check_aligned(out, "out");
    check(ld_out % 8 == 0 && ld_out >= n, "ld_out", "a multiple of 8 and >= n", to_text(ld_out));
    p.out = out;
    p.ld_out = ld_out;
  } else {
    set_output(p, static_cast<__nv_bfloat16*>(out), ld_out, n, scatter);
  }
}

// Form F over `d` with the input-gradient epilogue the arguments ask for.
template <class F>
void launch_input_gradient(const GemmDescriptor& d, const SwigluBackwardEpilogue& sw, bool out_fp32,
                           const RowScatter& scatter, cudaStream_t stream,
                           const Fp8Params& fp8 = {}) {
  if (sw.d_gate != nullptr) {
    with_flag(sw.row_scale != nullptr, [&](auto scaled) {
      with_flag(sw.dot != nullptr, [&](auto dot) {
        with_flag(sw.limit.has_value(), [&](auto clamped) {
          if constexpr (scaled() && dot()) {
            with_flag(sw.scaled_hidden != nullptr, [&](auto wh) {
              launch<F, epilogue::SwigluBackward<true, true, clamped(), wh()>>(d, stream, fp8);
            });
          } else {
            launch<F, epilogue::SwigluBackward<scaled(), dot(), clamped()>>(d, stream, fp8);
          }
        });
      });
    });
  } else if (out_fp32) {
    launch<F, epilogue::RowsFp32>(d, stream, fp8);
  } else {
    with_flag(scatter.rows != nullptr, [&](auto scattered) {
      launch<F, epilogue::RowsBf16<false, scattered()>>(d, stream, fp8);
    });
  }
}

}  // namespace

template <class F>
std::optional<GemmDescriptor> describe_rows_times_weight(const RowsTimesWeightArgs& args) {
  check_segments(args.segments);
  check_multiple_of_64(args.n, "n");
  check_multiple_of_64(args.k, "k");
  const RowSegments& s = args.segments;
  check_input_gradient_epilogue(args.swiglu);
  const bool dual = args.a2 != nullptr;
  check(dual == (args.w2 != nullptr), "a2/w2", "both device pointers or both null",
        "one of them null");
  if (s.capacity_rows == 0) return std::nullopt;
  const WeightMap w = weight_map(args.w_strides, s.num_groups, args.k, args.n);
  const CUtensorMap a =
      make_tensor_map_bf16(args.a, s.capacity_rows, args.k, args.ld_a, F::kBoxRowsA, "a");
  const CUtensorMap b = make_tensor_map_bf16(args.w, w.map_rows, args.n, w.ld, F::kBoxRowsB, "w");
  GemmDescriptor d = base_descriptor(s, args.waits);
  d.a = d.a2 = d.out = a;
  d.b = d.b2 = b;
  GemmParams& p = d.p;
  p.sched.n_tiles = ceil_div(args.n, F::kOutTileN);
  p.sched.k_blocks = (dual ? 2 : 1) * (args.k / kTileK);
  p.k_blocks_first = dual ? args.k / kTileK : 0;
  p.n = args.n;
  p.b_rows_per_group = static_cast<int>(w.rows_per_group);
  set_input_gradient_outputs(p, args.swiglu, args.out, args.ld_out, args.out_fp32, args.scatter,
                             args.n);
  if (dual) {
    d.a2 = make_tensor_map_bf16(args.a2, s.capacity_rows, args.k, args.ld_a2, F::kBoxRowsA, "a2");
    d.b2 = make_tensor_map_bf16(args.w2, w.map_rows, args.n, w.ld, F::kBoxRowsB, "w2");
  }
  return d;
}

namespace {

// RowsTimesWeightFp8Args::quantized (set): what it needs and its outputs' sizes and alignment,
// mok::Error naming the argument.
void check_quantized_swiglu(const RowsTimesWeightFp8Args& args) {
  const SwigluBackwardFp8Out& q = args.quantized;
  const SwigluBackwardEpilogue& sw = args.swiglu;
  const std::int64_t rows = args.segments.capacity_rows;
  const bool tokens = q.tokens();
  check(q.d_gate_rows.data != nullptr && q.d_up_rows.data != nullptr &&
            (q.d_gate_tokens.data != nullptr) == (q.d_up_tokens.data != nullptr),
        "quantized",
        "all four of d_gate_rows, d_up_rows, d_gate_tokens, d_up_tokens, the two rows forms "
        "alone, or none",
        "d_gate_rows " + to_text(static_cast<const void*>(q.d_gate_rows.data)) + ", d_up_rows " +
            to_text(static_cast<const void*>(q.d_up_rows.data)) + ", d_gate_tokens " +
            to_text(static_cast<const void*>(q.d_gate_tokens.data)) + ", d_up_tokens " +
            to_text(static_cast<const void*>(q.d_up_tokens.data)));
  check(sw.gate != nullptr && sw.up != nullptr, "swiglu.gate/up",
        "device pointers (quantized outputs come from the SwiGLU backward)", "null");
  check((sw.d_gate == nullptr) == (sw.d_up == nullptr), "swiglu.d_gate/d_up",
        "both device pointers or both null", "one of them null");
  check(tokens || sw.d_gate != nullptr, "swiglu.d_gate/d_up",
        "device pointers with the rows forms alone (dg and du are written in bf16 as well)",
        "null");
  check(sw.row_scale != nullptr && sw.dot != nullptr, "swiglu.row_scale/dot",
        "both set with quantized outputs (the one epilogue compiled with them)",
        "row_scale " + to_text(sw.row_scale) + ", dot " + to_text(sw.dot));
  check_rows_out(q.d_gate_rows, args.n, rows, "quantized.d_gate_rows");
  check_rows_out(q.d_up_rows, args.n, rows, "quantized.d_up_rows");
  const Fp8Out &gr = q.d_gate_rows, &ur = q.d_up_rows, &gt = q.d_gate_tokens, &ut = q.d_up_tokens;
  check(ur.ld == gr.ld && ur.scale_ld == gr.scale_ld, "quantized.d_up_rows",
        "d_gate_rows' ld and scale_ld (" + to_text(gr.ld) + ", " + to_text(gr.scale_ld) + ")",
        to_text(ur.ld) + ", " + to_text(ur.scale_ld));
  if (!tokens) {
    check(!args.pairs && !args.overlap, "quantized",
          "the plain or the wide mainloop with the rows forms alone (no pairs or overlap)",
          std::string("with") + (args.pairs ? " pairs" : "") + (args.overlap ? " overlap" : ""));
    return;
  }
  check(sw.scaled_hidden == nullptr, "swiglu.scaled_hidden", "null with the token-axis outputs",
        to_text(sw.scaled_hidden));
  check(!args.pairs && !args.overlap && !args.wide, "quantized",
        "the plain mainloop with the token-axis outputs (no pairs, overlap or wide)",
        std::string("with") + (args.pairs ? " pairs" : "") + (args.overlap ? " overlap" : "") +
            (args.wide ? " wide" : ""));
  check(ut.ld == gt.ld && ut.scale_ld == gt.scale_ld, "quantized.d_up_tokens",
        "d_gate_tokens' ld and scale_ld (" + to_text(gt.ld) + ", " + to_text(gt.scale_ld) + ")",
        to_text(ut.ld) + ", " + to_text(ut.scale_ld));
  // The token-axis form: 16-byte stores of a column's 32 rows and 8-byte stores of two columns'
  // scales. A tile stores all 128 rows of its token block down each column, rows past the count
  // as 0.
  const std::int64_t block_rows = (rows + 127) / 128 * 128;
  check(gt.ld >= block_rows && gt.ld % 16 == 0, "quantized.d_gate_tokens.ld",
        "a multiple of 16 and >= segments.capacity_rows rounded up to 128 (" + to_text(block_rows) +
            ")",
        to_text(gt.ld));
  check(gt.scale_ld >= args.n && gt.scale_ld % 2 == 0, "quantized.d_gate_tokens.scale_ld",
        "even and >= n (" + to_text(args.n) + ")", to_text(gt.scale_ld));
  const auto aligned = [](const void* ptr, std::uintptr_t bytes, const std::string& name) {
    check(ptr != nullptr && reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0, name,
          "a device pointer with " + to_text(static_cast<long long>(bytes)) + "-byte alignment",
          to_text(ptr));
  };
  aligned(gt.data, 16, "quantized.d_gate_tokens.data");
  aligned(ut.data, 16, "quantized.d_up_tokens.data");
  aligned(gt.scale, 8, "quantized.d_gate_tokens.scale");
  aligned(ut.scale, 8, "quantized.d_up_tokens.scale");
}

// The quantized outputs (checked) into the kernel's Fp8Params.
void set_quantized_outputs(const SwigluBackwardFp8Out& q, Fp8Params& p) {
  const Fp8Out &gr = q.d_gate_rows, &ur = q.d_up_rows, &gt = q.d_gate_tokens, &ut = q.d_up_tokens;
  p.q_rows[0] = gr.data, p.q_rows[1] = ur.data;
  p.q_rows_scales[0] = gr.scale, p.q_rows_scales[1] = ur.scale;
  p.q_rows_ld = gr.ld, p.q_rows_scale_ld = gr.scale_ld;
  p.q_tokens[0] = gt.data, p.q_tokens[1] = ut.data;
  p.q_tokens_scales[0] = gt.scale, p.q_tokens_scales[1] = ut.scale;
  p.q_tokens_ld = gt.ld, p.q_tokens_scale_ld = gt.scale_ld;
}

// The e4m3 input gradient whose SwiGLU backward quantizes dg and du: a staging tile in the ring.
using Fp8RowsWTStaged = Form<FormKind::kRowsWT, Operand::e4m3, false, false, true>;

template <class F>
void rows_times_weight_fp8_launch(const RowsTimesWeightFp8Args& args) {
  static_assert(F::kInputGradient, "e4m3 input gradients: rows x W^T over the W^T copies");
  check_segments(args.segments);
  check_multiple_of_128(args.n, "n");
  check_multiple_of_128(args.k, "k");
  check_wide_n<F>(args.n, "n");
  const bool quantized = args.quantized.any();
  if (quantized) {
    check_quantized_swiglu(args);
  } else {
    check_input_gradient_epilogue(args.swiglu);
  }
  const bool dual = args.a2.data != nullptr;
  check(dual == (args.w2_t.data != nullptr), "a2/w2_t", "both device pointers or both null",
        "one of them null");
  const RowSegments& s = args.segments;
  if (s.capacity_rows == 0) return;
  GemmDescriptor d = base_descriptor(s, args.waits);
  d.a = d.a2 = d.out = fp8_rows_map(args.a, s.capacity_rows, args.k, F::kBoxRowsA, "a");
  d.b = d.b2 = fp8_weight_map(args.w_t, s.num_groups, args.n, args.k, F::kBoxRowsB, "w_t");
  if (dual) {
    check(args.a2.scale_ld == args.a.scale_ld, "a2.scale_ld",
          "a.scale_ld (" + to_text(args.a.scale_ld) + ")", to_text(args.a2.scale_ld));
    d.a2 = fp8_rows_map(args.a2, s.capacity_rows, args.k, F::kBoxRowsA, "a2");
    d.b2 = fp8_weight_map(args.w2_t, s.num_groups, args.n, args.k, F::kBoxRowsB, "w2_t");
  }
  GemmParams& p = d.p;
  const int k_blocks = args.k / F::kBlockK;
  p.sched.n_tiles = ceil_div(args.n, F::kOutTileN);
  p.sched.k_blocks = (dual ? 2 : 1) * k_blocks;
  p.k_blocks_first = dual ? k_blocks : 0;
  p.n = args.n;
  p.b_rows_per_group = args.n;
  set_input_gradient_outputs(p, args.swiglu, args.out, args.ld_out, args.out_fp32, args.scatter,
                             args.n);
  Fp8Params fp8{args.a.scale,    args.a2.scale, args.a.scale_ld, args.w_t.scale,
                args.w2_t.scale, args.n / 128,  k_blocks};
  if (quantized && args.quantized.tokens()) {
    set_quantized_outputs(args.quantized, fp8);
    with_flag(args.swiglu.limit.has_value(), [&](auto clamped) {
      launch<Fp8RowsWTStaged, epilogue::SwigluBackward<true, true, clamped(), false,
                                                       QuantizedDgDu::rows_and_tokens>>(
          d, args.stream, fp8);
    });
    return;
  }
  if (quantized) {  // the rows forms alone, on F (plain or wide: check_quantized_swiglu)
    set_quantized_outputs(args.quantized, fp8);
    with_flag(args.swiglu.limit.has_value(), [&](auto clamped) {
      with_flag(args.swiglu.scaled_hidden != nullptr, [&](auto wh) {
        launch<F, epilogue::SwigluBackward<true, true, clamped(), wh(), QuantizedDgDu::rows>>(
            d, args.stream, fp8);
      });
    });
    return;
  }
  with_mainloop<Fp8RowsWT>(args.pairs, args.overlap, args.wide, [&](auto form) {
    launch_input_gradient<typename decltype(form)::type>(d, args.swiglu, args.out_fp32,
                                                         args.scatter, args.stream, fp8);
  });
}

template <class F>
void rows_times_weight_form(const RowsTimesWeightArgs& args) {
  const std::optional<GemmDescriptor> described = describe_rows_times_weight<F>(args);
  if (!described) return;
  launch_input_gradient<F>(*described, args.swiglu, args.out_fp32, args.scatter, args.stream);
}

}  // namespace

// The K-grouped forms' descriptor from their operands' maps: the output, the pass plan and the
// tile order (bf16: describe_weight_grad; e4m3: weight_grad_fp8).
template <class F>
GemmDescriptor weight_grad_descriptor(const WeightGradArgs& args, const CUtensorMap& a,
                                      const CUtensorMap& b);

template <class F>
std::optional<GemmDescriptor> describe_weight_grad(const WeightGradArgs& args) {
  check_segments(args.segments);
  check_multiple_of_64(args.m, "m");
  check_multiple_of_64(args.n, "n");
  const RowSegments& s = args.segments;
  // NOTES: with no rows the outputs are still written (zeros); the maps then cover one row that
  // is never read.
  const int rows = s.capacity_rows > 0 ? s.capacity_rows : 1;
  const CUtensorMap a = make_tensor_map_bf16(args.a, rows, args.m, args.ld_a, F::kBoxRowsA, "a");
  const CUtensorMap b = make_tensor_map_bf16(args.b, rows, args.n, args.ld_b, F::kBoxRowsB, "b");
  return weight_grad_descriptor<F>(args, a, b);
}

template <class F>
GemmDescriptor weight_grad_descriptor(const WeightGradArgs& args, const CUtensorMap& a,
                                      const CUtensorMap& b) {
  check(args.out != nullptr, "out", "a device pointer", "null");
  check_aligned(args.out, "out");
  check(args.ld_out % 8 == 0 && args.ld_out >= args.n, "ld_out", "a multiple of 8 and >= n",
        to_text(args.ld_out));
  const long long dense = static_cast<long long>(args.m) * args.ld_out;
  const long long group_stride = args.out_group_stride == 0 ? dense : args.out_group_stride;
  check(group_stride >= dense && group_stride % args.ld_out == 0, "out_group_stride",
        "0, or a multiple of ld_out (" + to_text(args.ld_out) + ") >= m * ld_out (" +
            to_text(dense) + ")",
        to_text(args.out_group_stride));
  const RowSegments& s = args.segments;
  // The TMA store's row coordinate, group * (group_stride / ld_out) + row, is a 32-bit integer.
  const long long map_rows = static_cast<long long>(s.num_groups) * (group_stride / args.ld_out);
  check(map_rows < (1LL << 31), "out_group_stride",
        "num_groups * out_group_stride / ld_out below 2^31", to_text(map_rows));
  GemmDescriptor d = base_descriptor(s, args.waits);
  d.a = d.a2 = d.out = a;
  d.b = d.b2 = b;
  GemmParams& p = d.p;
  p.sched.m_tiles = ceil_div(args.m, kTileM);
  p.sched.n_tiles = ceil_div(args.n, F::kOutTileN);
  p.m = args.m;
  p.n = args.n;
  p.out = args.out;
  p.ld_out = args.ld_out;
  p.out_group_stride = group_stride;
  p.out_map_group_rows = static_cast<int>(group_stride / args.ld_out);
  check(!args.accumulate || args.out_fp32, "accumulate", "an fp32 output (out_fp32)",
        "a bf16 output");
  const PassPlan& plan = args.passes;
  if (plan.steps == nullptr) {
    check(!args.continue_reduction || args.out_fp32, "continue_reduction",
          "an fp32 output (out_fp32), or a pass plan (passes.steps)", "a bf16 output");
    check(!(args.accumulate && args.continue_reduction), "accumulate/continue_reduction",
          "at most one of them without a pass plan", "both");
  } else {
    // NOTES: the plan's slots are [m, n] fp32 matrices with ld n; plain launches write them
    // (kOpen), continued ones read and write them.
    check(plan.slots >= 0, "passes.slots", ">= 0", to_text(plan.slots));
    check(plan.slots == 0 || plan.carry != nullptr, "passes.carry",
          "a device pointer to passes.slots fp32 [m, n] matrices", "null");
    check_aligned(plan.carry, "passes.carry");
    p.sched.steps = plan.steps;
    p.sched.first_step = args.continue_reduction ? kCarry : kWhole;
    p.sched.slots = plan.slots;
    p.carry = plan.carry;
  }
  // NOTES: the counter pair is the caller's (WeightGradArgs::tickets), so no two launches share
  // one unless the caller says so: launches in flight at once each have their own.
  if (args.tickets == nullptr) {
    check(args.order != TileOrder::tickets, "WeightGradArgs.tickets",
          "2 zeroed words of device memory (order = TileOrder::tickets draws tiles from them)",
          "null");
  }
  check(reinterpret_cast<std::uintptr_t>(args.tickets) % 4 == 0, "WeightGradArgs.tickets",
        "4-byte alignment", to_text(args.tickets));
  p.tickets = args.tickets;
  p.tile_order = static_cast<int>(args.tickets == nullptr ? TileOrder::fixed : args.order);
  if constexpr (F::kTmaStore) {
    if (!args.out_fp32) {
      // NOTES: 64 x 64 boxes (epilogue.cuh, store_tile_tma); groups are out_map_group_rows rows
      // apart (m when dense). No box reaches past its group's m rows (m is a multiple of 64), so
      // the rows between groups (the other half of a packed gradient) are never written.
      d.out = make_tensor_map_bf16(args.out, map_rows, args.n, args.ld_out, 64, "out");
    }
  }
  return d;
}

namespace {

// Form F over `d` with the K-grouped epilogue the arguments ask for.
template <class F>
void launch_weight_grad(const GemmDescriptor& d, const WeightGradArgs& args,
                        const Fp8Params& fp8 = {}) {
  using epilogue::GradOut;
  if (!args.out_fp32) {
    launch<F, epilogue::WeightGrad<GradOut::bf16>>(d, args.stream, fp8);
  } else if (args.accumulate) {
    launch<F, epilogue::WeightGrad<GradOut::fp32_add>>(d, args.stream, fp8);
  } else {
    launch<F, epilogue::WeightGrad<GradOut::fp32>>(d, args.stream, fp8);
  }
}

template <class F>
void weight_grad_form(const WeightGradArgs& args) {
  launch_weight_grad<F>(*describe_weight_grad<F>(args), args);
}

// The e4m3 weight gradient of form F (plain or continued).
template <class F>
void weight_grad_fp8_form(const WeightGradFp8Args& args) {
  const WeightGradArgs& g = args.grad;
  check_segments(g.segments);
  check_multiple_of_128(g.m, "grad.m");
  check_multiple_of_128(g.n, "grad.n");
  check(g.a == nullptr && g.b == nullptr, "grad.a/grad.b", "null (the e4m3 operands are a, b)",
        "set");
  const RowSegments& s = g.segments;
  // The token blocks' scales: one row of them per 128 rows of the row buffers.
  const int rows = s.capacity_rows > 0 ? s.capacity_rows : 1;
  auto operand = [&](const Fp8TokenAxis& t, int cols, int box_rows, const std::string& name) {
    check(t.scale != nullptr, name + ".scale", "a device pointer", "null");
    check(reinterpret_cast<std::uintptr_t>(t.scale) % 16 == 0, name + ".scale", "16-byte alignment",
          to_text(t.scale));
    check(t.scale_ld >= cols && t.scale_ld % 4 == 0, name + ".scale_ld",
          "a multiple of 4 and >= " + to_text(cols), to_text(t.scale_ld));
    return make_tensor_map_e4m3(t.data, cols, rows, t.ld, box_rows, (name + ".data").c_str());
  };
  const CUtensorMap a = operand(args.a, g.m, F::kBoxRowsA, "a");
  const CUtensorMap b = operand(args.b, g.n, F::kBoxRowsB, "b");
  const GemmDescriptor d = weight_grad_descriptor<F>(g, a, b);
  const Fp8Params fp8{args.a.scale,   nullptr, args.a.scale_ld, args.b.scale, nullptr, 0, 0,
                      args.b.scale_ld};
  launch_weight_grad<F>(d, g, fp8);
}

}  // namespace

// Every form's descriptor, for kernels that run the GEMM themselves (the forward megakernel,
// kernels/fused_forward.cuh, from layer.cu's fused_pass; tests/cpp/support/kernel_hooks.cu's
// stall kernels).
template std::optional<GemmDescriptor> describe_gate_up_forward<Form<FormKind::kGateUp>>(
    const GateUpForwardArgs&);
template std::optional<GemmDescriptor> describe_rows_times_weight_t<Form<FormKind::kRowsWT>>(
    const RowsTimesWeightTArgs&);
template std::optional<GemmDescriptor> describe_rows_times_weight<Form<FormKind::kRowsW>>(
    const RowsTimesWeightArgs&);
template std::optional<GemmDescriptor> describe_weight_grad<Form<FormKind::kWeightGrad>>(
    const WeightGradArgs&);
template std::optional<GemmDescriptor> describe_weight_grad<Form<FormKind::kWeightGradContinued>>(
    const WeightGradArgs&);

void gate_up_forward(const GateUpForwardArgs& args) {
  gate_up_forward_form<Form<FormKind::kGateUp>>(args);
}

void rows_times_weight_t(const RowsTimesWeightTArgs& args) {
  rows_times_weight_t_form<Form<FormKind::kRowsWT>>(args);
}

void rows_times_weight(const RowsTimesWeightArgs& args) {
  rows_times_weight_form<Form<FormKind::kRowsW>>(args);
}

void weight_grad_fp8(const WeightGradFp8Args& args) {
  with_flag(args.overlap, [&](auto overlap) {
    if (args.grad.continue_reduction) {
      // A continued reduction's outputs are fp32: nothing to stage (tma_store changes nothing).
      weight_grad_fp8_form<Form<FormKind::kWeightGradContinued, Operand::e4m3, false, overlap()>>(
          args);
    } else {
      with_flag(args.tma_store, [&](auto staged) {
        weight_grad_fp8_form<
            Form<FormKind::kWeightGrad, Operand::e4m3, false, overlap(), staged()>>(args);
      });
    }
  });
}

void weight_grad(const WeightGradArgs& args) {
  if (args.continue_reduction) {
    weight_grad_form<Form<FormKind::kWeightGradContinued>>(args);
  } else {
    weight_grad_form<Form<FormKind::kWeightGrad>>(args);
  }
}

}  // namespace mok::gemm
