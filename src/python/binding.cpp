// mok._C: the torch-free C++ API as seen from Python (nanobind).
//
// Tensors cross this boundary as plain tuples describing a view, built in Python from a tensor's
// metadata (mok/_native.py, `view_of`):
//
//   (data_ptr: int, dtype: str, shape: tuple[int], strides: tuple[int], device: str, index: int,
//    math_bit: str)
//
// or None for an absent tensor (no shared expert). So the extension never includes torch headers
// and one build works with any torch version. math_bit is "" for a tensor whose memory holds its
// values, "negated" / "conjugated" for one with torch's negation or conjugation bit (its memory
// holds the values before that operation): such a view is refused, naming the argument. The
// binding does no layer maths: it builds mok::TensorView values and calls mok::forward / backward
// / recompute_forward_context.
//
// Errors: mok::Error becomes TypeError when the rejected argument is a dtype, ValueError for any
// other argument (shape, strides, device, value), and RuntimeError when it names no argument (a
// backend that is not available). The message is mok's own text, unchanged.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/gemm_ops.hpp"
#include "core/validate.hpp"
#include "mok/fp8.hpp"
#include "mok/host_ep.hpp"
#include "mok/mok.hpp"
#include "mok/schedule.hpp"

namespace nb = nanobind;

namespace mok {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

PyObject* python_type_of(const Error& e) {
  const std::string& arg = e.argument();
  if (arg.empty()) return PyExc_RuntimeError;
  if (ends_with(arg, ".dtype") || ends_with(arg, "dtype")) return PyExc_TypeError;
  return PyExc_ValueError;
}

DType parse_dtype(const std::string& name, const std::string& arg) {
  if (name == "bfloat16") return DType::bf16;
  if (name == "float32") return DType::f32;
  if (name == "float64") return DType::f64;
  if (name == "int32") return DType::i32;
  if (name == "int64") return DType::i64;
  if (name == "float8_e4m3fn") return DType::fp8_e4m3;  // mok's FP8 calls (mok/fp8.hpp) only
  if (name == "uint8") return DType::u8;
  throw Error(arg + ".dtype",
              "one of bfloat16, float32, float64, int32, int64, float8_e4m3fn, uint8", name);
}

Device parse_device(const std::string& type, int index, const std::string& arg) {
  if (type == "cpu") return {DeviceKind::cpu, 0};
  if (type == "cuda") return {DeviceKind::cuda, index};
  throw Error(arg + ".device", "cpu or cuda", type);
}

Backend parse_backend(const std::string& name) {
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  if (name == "auto") return Backend::automatic;
  throw Error("backend", "cpu, cuda or auto", name);
}

// A view tuple (see the top of this file), or None for "absent".
TensorView view_of(nb::handle h, const char* name) {
  TensorView v;
  if (h.is_none()) return v;
  const std::string arg = name;
  auto t = nb::cast<nb::tuple>(h);
  if (t.size() != 7) throw Error(arg, "a 7-field view tuple", to_text(t.size()) + " fields");
  const auto math_bit = nb::cast<std::string>(t[6]);
  if (!math_bit.empty()) {
    throw Error(arg,
                "a tensor whose memory holds its values (mok reads the memory: resolve torch's "
                "negation or conjugation bit first, " +
                    arg + ".resolve_neg() / .resolve_conj())",
                "a " + math_bit + " view");
  }
  auto shape = nb::cast<nb::tuple>(t[2]);
  auto strides = nb::cast<nb::tuple>(t[3]);
  if (shape.size() > static_cast<size_t>(TensorView::kMaxDims)) {
    throw Error(arg + ".ndim", "at most " + to_text(TensorView::kMaxDims), to_text(shape.size()));
  }
  if (strides.size() != shape.size()) {
    throw Error(arg + ".strides", to_text(shape.size()) + " strides", to_text(strides.size()));
  }
  v.data = reinterpret_cast<void*>(nb::cast<std::uintptr_t>(t[0]));
  v.dtype = parse_dtype(nb::cast<std::string>(t[1]), arg);
  v.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = nb::cast<std::int64_t>(shape[d]);
    v.strides[d] = nb::cast<std::int64_t>(strides[d]);
  }
  v.device = parse_device(nb::cast<std::string>(t[4]), nb::cast<int>(t[5]), arg);
  return v;
}

Inputs inputs_of(nb::handle x, nb::handle topk_experts, nb::handle topk_weights) {
  return {view_of(x, "x"), view_of(topk_experts, "topk_experts"),
          view_of(topk_weights, "topk_weights")};
}

// Python's float (a double) as Weights::swiglu_limit: None, or a finite positive value that is
// still one as a float32 (the C++ API's type; check_swiglu_limit checks that form again).
std::optional<float> swiglu_limit_of(const std::optional<double>& limit) {
  if (!limit) return std::nullopt;
  const double l = *limit;
  if (!(std::isfinite(l) && l > 0.0)) {
    throw Error("swiglu_limit", "None or a finite positive number", to_text(l));
  }
  const auto f = static_cast<float>(l);
  if (!(std::isfinite(f) && f > 0.0f)) {
    throw Error("swiglu_limit", "a finite positive number as a float32", to_text(l));
  }
  return f;
}

Weights weights_of(nb::handle gate, nb::handle up, nb::handle down, nb::handle shared_gate,
                   nb::handle shared_up, nb::handle shared_down,
                   const std::optional<double>& swiglu_limit) {
  return {view_of(gate, "routed_gate_weights"),
          view_of(up, "routed_up_weights"),
          view_of(down, "routed_down_weights"),
          view_of(shared_gate, "shared_gate_weights"),
          view_of(shared_up, "shared_up_weights"),
          view_of(shared_down, "shared_down_weights"),
          swiglu_limit_of(swiglu_limit)};
}

// The FP8 layer's quantized routed weights (mok/_fp8_layer.py): None for the bf16 layer, or a
// sequence of 12 view tuples, (data, scales, data_t, scales_t) of gate, up and down in that order
// (down's four None where a call does not read it: recompute_forward_context).
std::optional<Fp8Weights> fp8_weights_of(nb::handle h) {
  if (h.is_none()) return std::nullopt;
  const auto t = nb::cast<nb::tuple>(h);
  if (t.size() != 12) {
    throw Error("fp8_weights", "12 views (data, scales, data_t, scales_t of gate, up, down)",
                to_text(t.size()) + " views");
  }
  static const char* const kNames[12] = {
      "fp8_weights.gate.data",     "fp8_weights.gate.scales", "fp8_weights.gate.data_t",
      "fp8_weights.gate.scales_t", "fp8_weights.up.data",     "fp8_weights.up.scales",
      "fp8_weights.up.data_t",     "fp8_weights.up.scales_t", "fp8_weights.down.data",
      "fp8_weights.down.scales",   "fp8_weights.down.data_t", "fp8_weights.down.scales_t"};
  auto one = [&](int i) {
    const int j = 4 * i;
    return QuantizedWeights{view_of(t[j], kNames[j]), view_of(t[j + 1], kNames[j + 1]),
                            view_of(t[j + 2], kNames[j + 2]), view_of(t[j + 3], kNames[j + 3])};
  };
  return Fp8Weights{one(0), one(1), one(2)};
}

// The forward context from its seven view tuples (x_routed, gate_routed, up_routed,
// hidden_routed, gate_shared, up_shared, hidden_shared; the shared ones None without a shared
// expert). NOTES: no ContextKey is recorded from Python: autograd pairs a backward with its
// forward's saved tensors, and torch.compile may rematerialize inputs (new data pointers) in the
// backward graph.
ForwardContext context_of(nb::handle x_routed, nb::handle gate_routed, nb::handle up_routed,
                          nb::handle hidden_routed, nb::handle gate_shared, nb::handle up_shared,
                          nb::handle hidden_shared) {
  ForwardContext c;
  c.x_routed = view_of(x_routed, "forward_context.x_routed");
  c.gate_routed = view_of(gate_routed, "forward_context.gate_routed");
  c.up_routed = view_of(up_routed, "forward_context.up_routed");
  c.hidden_routed = view_of(hidden_routed, "forward_context.hidden_routed");
  c.gate_shared = view_of(gate_shared, "forward_context.gate_shared");
  c.up_shared = view_of(up_shared, "forward_context.up_shared");
  c.hidden_shared = view_of(hidden_shared, "forward_context.hidden_shared");
  return c;
}

// Gradient views in mok's order (d_x, d_topk_weights, routed gate, up, down, shared gate, up,
// down; the shared ones None without a shared expert).
Grads grads_of(nb::handle d_x, nb::handle d_topk_weights, nb::handle d_gate, nb::handle d_up,
               nb::handle d_down, nb::handle d_shared_gate, nb::handle d_shared_up,
               nb::handle d_shared_down) {
  Grads g;
  g.d_x = view_of(d_x, "d_x");
  g.d_topk_weights = view_of(d_topk_weights, "d_topk_weights");
  g.d_gate = view_of(d_gate, "d_routed_gate_weights");
  g.d_up = view_of(d_up, "d_routed_up_weights");
  g.d_down = view_of(d_down, "d_routed_down_weights");
  g.d_shared_gate = view_of(d_shared_gate, "d_shared_gate_weights");
  g.d_shared_up = view_of(d_shared_up, "d_shared_up_weights");
  g.d_shared_down = view_of(d_shared_down, "d_shared_down_weights");
  return g;
}

Problem problem_of(std::int64_t T, std::int64_t H, std::int64_t I, std::int64_t E, std::int64_t k,
                   std::int64_t S, int ep_size, int ep_rank) {
  Problem p;
  p.num_tokens = T;
  p.hidden_size = H;
  p.intermediate_size = I;
  p.num_experts = E;
  p.topk = k;
  p.shared_intermediate_size = S;
  p.ep_size = ep_size;
  p.ep_rank = ep_rank;
  return p;
}

ForwardPath parse_forward_path(const std::string& name) {
  if (name == "launches") return ForwardPath::launches;
  if (name == "fused") return ForwardPath::fused;
  throw Error("config.forward_path", "'launches' or 'fused'", "'" + name + "'");
}

// MoKConfig's knobs: MoK's five, then mok's own (forward_path, fused_stage_rows).
Config config_of(int fwd_sms, int bwd_sms, std::int64_t minibatch, std::int64_t macrobatch,
                 double capacity_multiplier, const std::string& forward_path,
                 std::int64_t fused_stage_rows) {
  Config c;
  c.fwd_num_comm_sms = fwd_sms;
  c.bwd_num_comm_sms = bwd_sms;
  c.minibatch_size = minibatch;
  c.macrobatch_size = macrobatch;
  c.schedule_capacity_multiplier = capacity_multiplier;
  c.forward_path = parse_forward_path(forward_path);
  c.fused_stage_rows = fused_stage_rows;
  return c;
}

}  // namespace
}  // namespace mok

NB_MODULE(_C, m) {
  using namespace mok;
  m.doc() = "mok's torch-free C++ API (internal: use mok.functional, mok.ops, mok.nn)";
  m.attr("__version__") = kVersion;
  // Problem::validate's bounds (include/mok/problem.hpp), for Python's own checks.
  m.attr("max_size") = kMaxSize;
  m.attr("max_experts") = kMaxExperts;

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(python_type_of(e), e.what());
    }
  });

  m.def("backend_available",
        [](const std::string& b) { return backend_available(parse_backend(b)); });
  m.def(
      "require_backend", [](const std::string& b) { require_backend(parse_backend(b)); },
      "Raises mok's error saying why the backend cannot run here.");

  m.def(
      "validate_problem",
      [](std::int64_t T, std::int64_t H, std::int64_t I, std::int64_t E, std::int64_t k,
         std::int64_t S, int ep_size, int ep_rank, const std::string& activation_dtype) {
        problem_of(T, H, I, E, k, S, ep_size, ep_rank)
            .validate(parse_dtype(activation_dtype, "activation"));
      },
      nb::arg("num_tokens"), nb::arg("hidden_size"), nb::arg("intermediate_size"),
      nb::arg("num_experts"), nb::arg("topk"), nb::arg("shared_intermediate_size"),
      nb::arg("ep_size"), nb::arg("ep_rank"), nb::arg("activation_dtype"));

  // (x_rows, routed_rows) of the forward context a workspace of this shape and config uses.
  m.def(
      "context_rows",
      [](std::int64_t T, std::int64_t H, std::int64_t I, std::int64_t E, std::int64_t k,
         std::int64_t S, int ep_size, int ep_rank, int fwd_sms, int bwd_sms, std::int64_t mini,
         std::int64_t macro, double mult, const std::string& backend,
         const std::string& activation_dtype, const std::string& forward_path,
         std::int64_t fused_stage_rows) {
        const ForwardContextLayout l = forward_context_layout(
            problem_of(T, H, I, E, k, S, ep_size, ep_rank),
            config_of(fwd_sms, bwd_sms, mini, macro, mult, forward_path, fused_stage_rows),
            resolve_backend(parse_backend(backend)), parse_dtype(activation_dtype, "activation"));
        return nb::make_tuple(l.x_rows, l.routed_rows);
      },
      nb::kw_only(), nb::arg("num_tokens"), nb::arg("hidden_size"), nb::arg("intermediate_size"),
      nb::arg("num_experts"), nb::arg("topk"), nb::arg("shared_intermediate_size"),
      nb::arg("ep_size"), nb::arg("ep_rank"), nb::arg("fwd_num_comm_sms"),
      nb::arg("bwd_num_comm_sms"), nb::arg("minibatch_size"), nb::arg("macrobatch_size"),
      nb::arg("schedule_capacity_multiplier"), nb::arg("backend"), nb::arg("activation_dtype"),
      nb::arg("forward_path") = "launches", nb::arg("fused_stage_rows") = 0);

  m.def(
      "validate_config",
      [](int fwd, int bwd, std::int64_t mini, std::int64_t macro, double mult,
         const std::string& forward_path, std::int64_t fused_stage_rows) {
        config_of(fwd, bwd, mini, macro, mult, forward_path, fused_stage_rows).validate();
      },
      nb::arg("fwd_num_comm_sms"), nb::arg("bwd_num_comm_sms"), nb::arg("minibatch_size"),
      nb::arg("macrobatch_size"), nb::arg("schedule_capacity_multiplier"),
      nb::arg("forward_path") = "launches", nb::arg("fused_stage_rows") = 0);

  // The schedule's host twin (include/mok/schedule.hpp) on CPU tensors: rank `ep_rank`'s table
  // from every rank's topk_experts. Only T, k, E and W matter; H and I are placeholders.
  m.def(
      "schedule_capacity_rows",
      [](std::int64_t T, std::int64_t k, std::int64_t E, int ep_size) {
        const Problem p = problem_of(T, 1, 1, E, k, 0, ep_size, 0);
        p.validate(DType::f64);  // bounded sizes: the rows below cannot overflow
        return schedule_capacity_rows(p);
      },
      nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"), nb::arg("ep_size"));
  // Bytes of one rank's symmetric region (every rank of a team across processes allocates this
  // much, e.g. as PyTorch symmetric memory, and passes all ranks' addresses to Workspace).
  m.def(
      "symmetric_workspace_bytes",
      [](std::int64_t T, std::int64_t H, std::int64_t I, std::int64_t E, std::int64_t k,
         std::int64_t S, int ep_size, int ep_rank, int fwd_sms, int bwd_sms, std::int64_t mini,
         std::int64_t macro, double mult, const std::string& forward_path,
         std::int64_t fused_stage_rows) {
        return symmetric_workspace_bytes(
            problem_of(T, H, I, E, k, S, ep_size, ep_rank),
            config_of(fwd_sms, bwd_sms, mini, macro, mult, forward_path, fused_stage_rows));
      },
      nb::kw_only(), nb::arg("num_tokens"), nb::arg("hidden_size"), nb::arg("intermediate_size"),
      nb::arg("num_experts"), nb::arg("topk"), nb::arg("shared_intermediate_size"),
      nb::arg("ep_size"), nb::arg("ep_rank"), nb::arg("fwd_num_comm_sms"),
      nb::arg("bwd_num_comm_sms"), nb::arg("minibatch_size"), nb::arg("macrobatch_size"),
      nb::arg("schedule_capacity_multiplier"), nb::arg("forward_path") = "launches",
      nb::arg("fused_stage_rows") = 0);
  m.def(
      "schedule_table",
      [](const std::vector<nb::handle>& topk_experts, std::int64_t num_experts, int ep_rank,
         std::int64_t minibatch, std::int64_t macrobatch, nb::handle table, nb::handle counts,
         nb::handle src_counts, nb::handle starts, nb::handle plan) {
        std::vector<TensorView> ids;
        for (std::size_t r = 0; r < topk_experts.size(); ++r) {
          ids.push_back(view_of(topk_experts[r], "topk_experts"));
        }
        if (ids.empty()) throw Error("topk_experts", "one tensor per rank", "an empty list");
        const Problem p = problem_of(ids[0].shape[0], 1, 1, num_experts, ids[0].shape[1], 0,
                                     static_cast<int>(ids.size()), ep_rank);
        Config c;
        c.minibatch_size = minibatch;
        c.macrobatch_size = macrobatch;
        const ScheduleViews out{view_of(table, "table"), view_of(counts, "expert_counts"),
                                view_of(src_counts, "expert_src_counts"),
                                view_of(starts, "segment_starts"), view_of(plan, "ring_plan")};
        nb::gil_scoped_release release;
        build_schedule_cpu(p, c, ids, out);
      },
      nb::arg("topk_experts"), nb::arg("num_experts"), nb::arg("ep_rank"),
      nb::arg("minibatch_size"), nb::arg("macrobatch_size"), nb::arg("table"),
      nb::arg("expert_counts"), nb::arg("expert_src_counts"), nb::arg("segment_starts"),
      nb::arg("ring_plan"));

  // Every id of a host-readable topk_experts in [-1, num_experts); the error names the entry.
  m.def(
      "check_expert_ids",
      [](nb::handle topk_experts, std::int64_t num_experts) {
        const TensorView v = view_of(topk_experts, "topk_experts");
        if (v.ndim != 2) throw Error("topk_experts.ndim", "2", to_text(v.ndim));
        check_view("topk_experts", v, DType::i64, {v.shape[0], v.shape[1]}, Device{});
        Problem p;
        p.num_tokens = v.shape[0];
        p.topk = v.shape[1];
        p.num_experts = num_experts;
        nb::gil_scoped_release release;
        check_expert_ids_host(p, v);
      },
      nb::arg("topk_experts"), nb::arg("num_experts"));

  nb::class_<Workspace>(m, "Workspace")
      .def(
          "__init__",
          [](Workspace* self, std::int64_t T, std::int64_t H, std::int64_t I, std::int64_t E,
             std::int64_t k, std::int64_t S, int ep_size, int ep_rank, int fwd_sms, int bwd_sms,
             std::int64_t mini, std::int64_t macro, double mult, const std::string& backend,
             const std::string& activation_dtype, int num_threads, int device_index,
             const std::vector<std::uintptr_t>& symmetric_bases, std::uint64_t barrier_timeout_ms,
             const std::string& forward_path, std::int64_t fused_stage_rows, bool fp8,
             bool fp8_token_axis) {
            WorkspaceOptions o;
            o.fp8 = fp8;
            o.fp8_token_axis = fp8_token_axis;
            o.backend = parse_backend(backend);
            o.activation_dtype = parse_dtype(activation_dtype, "activation");
            o.num_threads = num_threads;
            o.device_index = device_index;
            for (std::uintptr_t b : symmetric_bases) {
              o.symmetric_bases.push_back(reinterpret_cast<void*>(b));
            }
            o.barrier_timeout_ms = barrier_timeout_ms;
            new (self) Workspace(
                problem_of(T, H, I, E, k, S, ep_size, ep_rank),
                config_of(fwd_sms, bwd_sms, mini, macro, mult, forward_path, fused_stage_rows), o);
          },
          nb::kw_only(), nb::arg("num_tokens"), nb::arg("hidden_size"),
          nb::arg("intermediate_size"), nb::arg("num_experts"), nb::arg("topk"),
          nb::arg("shared_intermediate_size"), nb::arg("ep_size"), nb::arg("ep_rank"),
          nb::arg("fwd_num_comm_sms"), nb::arg("bwd_num_comm_sms"), nb::arg("minibatch_size"),
          nb::arg("macrobatch_size"), nb::arg("schedule_capacity_multiplier"), nb::arg("backend"),
          nb::arg("activation_dtype"), nb::arg("num_threads"), nb::arg("device_index"),
          nb::arg("symmetric_bases") = std::vector<std::uintptr_t>{},
          nb::arg("barrier_timeout_ms") = 10000, nb::arg("forward_path") = "launches",
          nb::arg("fused_stage_rows") = 0, nb::arg("fp8") = false,
          nb::arg("fp8_token_axis") = true)
      .def_prop_ro("backend",
                   [](const Workspace& ws) { return std::string(backend_name(ws.backend())); })
      .def_prop_ro(
          "activation_dtype",
          [](const Workspace& ws) { return std::string(dtype_name(ws.activation_dtype())); })
      .def_prop_ro("num_threads", &Workspace::num_threads)
      .def_prop_ro("bytes", &Workspace::bytes)
      .def_prop_ro("problem", [](const Workspace& ws) { return ws.problem().to_string(); })
      .def_prop_ro("config", [](const Workspace& ws) { return ws.config().to_string(); })
      // CUDA backend: the cudaStream_t (as an int, e.g. torch.cuda.current_stream().cuda_stream)
      // that the next calls enqueue on.
      .def(
          "set_stream",
          [](Workspace& ws, std::uintptr_t stream) {
            ws.set_stream(reinterpret_cast<void*>(stream));
          },
          nb::arg("stream"))
      // (forward, recompute_forward_context, backward) calls run so far.
      .def_prop_ro("call_counts", [](const Workspace& ws) {
        const Workspace::CallCounts c = ws.call_counts();
        return nb::make_tuple(c.forward, c.recompute, c.backward);
      });

  // The grouped GEMM forms (mok.ops.grouped_*): views in, one launch on `stream` (an int
  // cudaStream_t), GIL released while the launch is enqueued.
  m.def(
      "grouped_gate_up",
      [](nb::handle x, nb::handle w_gate, nb::handle w_up, nb::handle starts, nb::handle rows,
         nb::handle hidden, nb::handle gate, nb::handle up, std::uintptr_t stream) {
        const gemm_ops::Groups g{view_of(starts, "starts"), view_of(rows, "rows")};
        const TensorView xv = view_of(x, "x"), wg = view_of(w_gate, "w_gate"),
                         wu = view_of(w_up, "w_up"), h = view_of(hidden, "hidden"),
                         gv = view_of(gate, "gate"), uv = view_of(up, "up");
        nb::gil_scoped_release release;
        gemm_ops::gate_up(xv, wg, wu, g, h, gv, uv, reinterpret_cast<void*>(stream));
      },
      nb::arg("x"), nb::arg("w_gate"), nb::arg("w_up"), nb::arg("starts"), nb::arg("rows"),
      nb::arg("hidden"), nb::arg("gate").none(), nb::arg("up").none(), nb::arg("stream"));
  m.def(
      "grouped_rows_times_weight_t",
      [](nb::handle a, nb::handle w, nb::handle starts, nb::handle rows, nb::handle row_scale,
         nb::handle out, std::uintptr_t stream) {
        const gemm_ops::Groups g{view_of(starts, "starts"), view_of(rows, "rows")};
        const TensorView av = view_of(a, "a"), wv = view_of(w, "w"),
                         sv = view_of(row_scale, "row_scale"), ov = view_of(out, "out");
        nb::gil_scoped_release release;
        gemm_ops::rows_times_weight_t(av, wv, g, sv, ov, reinterpret_cast<void*>(stream));
      },
      nb::arg("a"), nb::arg("w"), nb::arg("starts"), nb::arg("rows"), nb::arg("row_scale").none(),
      nb::arg("out"), nb::arg("stream"));
  m.def(
      "grouped_rows_times_weight",
      [](nb::handle a, nb::handle w, nb::handle starts, nb::handle rows, nb::handle out,
         std::uintptr_t stream) {
        const gemm_ops::Groups g{view_of(starts, "starts"), view_of(rows, "rows")};
        const TensorView av = view_of(a, "a"), wv = view_of(w, "w"), ov = view_of(out, "out");
        nb::gil_scoped_release release;
        gemm_ops::rows_times_weight(av, wv, g, ov, reinterpret_cast<void*>(stream));
      },
      nb::arg("a"), nb::arg("w"), nb::arg("starts"), nb::arg("rows"), nb::arg("out"),
      nb::arg("stream"));
  m.def(
      "grouped_weight_grad",
      [](nb::handle a, nb::handle b, nb::handle starts, nb::handle rows, nb::handle out,
         nb::handle tickets, bool accumulate, std::uintptr_t stream) {
        const gemm_ops::Groups g{view_of(starts, "starts"), view_of(rows, "rows")};
        const TensorView av = view_of(a, "a"), bv = view_of(b, "b"), ov = view_of(out, "out"),
                         tv = view_of(tickets, "tickets");
        nb::gil_scoped_release release;
        gemm_ops::weight_grad(av, bv, g, ov, tv, accumulate, reinterpret_cast<void*>(stream));
      },
      nb::arg("a"), nb::arg("b"), nb::arg("starts"), nb::arg("rows"), nb::arg("out"),
      nb::arg("tickets").none(), nb::arg("accumulate"), nb::arg("stream"));

  m.def(
      "forward",
      [](Workspace& ws, nb::handle x, nb::handle topk_experts, nb::handle topk_weights,
         nb::handle gate, nb::handle up, nb::handle down, nb::handle shared_gate,
         nb::handle shared_up, nb::handle shared_down, nb::handle out, nb::handle x_routed,
         nb::handle gate_routed, nb::handle up_routed, nb::handle hidden_routed,
         nb::handle gate_shared, nb::handle up_shared, nb::handle hidden_shared,
         std::optional<double> swiglu_limit, nb::handle fp8_weights) {
        const Inputs in = inputs_of(x, topk_experts, topk_weights);
        const Weights w =
            weights_of(gate, up, down, shared_gate, shared_up, shared_down, swiglu_limit);
        const TensorView o = view_of(out, "out");
        ForwardContext c = context_of(x_routed, gate_routed, up_routed, hidden_routed, gate_shared,
                                      up_shared, hidden_shared);
        const std::optional<Fp8Weights> q = fp8_weights_of(fp8_weights);
        nb::gil_scoped_release release;
        if (q) {
          forward(ws, in, w, *q, o, c);
        } else {
          forward(ws, in, w, o, c);
        }
      },
      nb::arg("workspace"), nb::arg("x"), nb::arg("topk_experts"), nb::arg("topk_weights"),
      nb::arg("routed_gate_weights"), nb::arg("routed_up_weights"), nb::arg("routed_down_weights"),
      nb::arg("shared_gate_weights").none(), nb::arg("shared_up_weights").none(),
      nb::arg("shared_down_weights").none(), nb::arg("out"), nb::arg("x_routed"),
      nb::arg("gate_routed"), nb::arg("up_routed"), nb::arg("hidden_routed"),
      nb::arg("gate_shared").none(), nb::arg("up_shared").none(), nb::arg("hidden_shared").none(),
      nb::arg("swiglu_limit").none() = nb::none(), nb::arg("fp8_weights").none() = nb::none());

  m.def(
      "recompute_forward_context",
      [](Workspace& ws, nb::handle x, nb::handle topk_experts, nb::handle gate, nb::handle up,
         nb::handle shared_gate, nb::handle shared_up, nb::handle x_routed, nb::handle gate_routed,
         nb::handle up_routed, nb::handle hidden_routed, nb::handle gate_shared,
         nb::handle up_shared, nb::handle hidden_shared, std::optional<double> swiglu_limit,
         nb::handle fp8_weights) {
        const Inputs in = inputs_of(x, topk_experts, nb::none());
        const Weights w =
            weights_of(gate, up, nb::none(), shared_gate, shared_up, nb::none(), swiglu_limit);
        ForwardContext c = context_of(x_routed, gate_routed, up_routed, hidden_routed, gate_shared,
                                      up_shared, hidden_shared);
        const std::optional<Fp8Weights> q = fp8_weights_of(fp8_weights);
        nb::gil_scoped_release release;
        if (q) {
          recompute_forward_context(ws, in, w, *q, c);
        } else {
          recompute_forward_context(ws, in, w, c);
        }
      },
      nb::arg("workspace"), nb::arg("x"), nb::arg("topk_experts"), nb::arg("routed_gate_weights"),
      nb::arg("routed_up_weights"), nb::arg("shared_gate_weights").none(),
      nb::arg("shared_up_weights").none(), nb::arg("x_routed"), nb::arg("gate_routed"),
      nb::arg("up_routed"), nb::arg("hidden_routed"), nb::arg("gate_shared").none(),
      nb::arg("up_shared").none(), nb::arg("hidden_shared").none(),
      nb::arg("swiglu_limit").none() = nb::none(), nb::arg("fp8_weights").none() = nb::none());

  m.def(
      "backward",
      [](Workspace& ws, nb::handle x, nb::handle topk_experts, nb::handle topk_weights,
         nb::handle gate, nb::handle up, nb::handle down, nb::handle shared_gate,
         nb::handle shared_up, nb::handle shared_down, nb::handle x_routed, nb::handle gate_routed,
         nb::handle up_routed, nb::handle hidden_routed, nb::handle gate_shared,
         nb::handle up_shared, nb::handle hidden_shared, nb::handle d_out, nb::handle d_x,
         nb::handle d_topk_weights, nb::handle d_gate, nb::handle d_up, nb::handle d_down,
         nb::handle d_shared_gate, nb::handle d_shared_up, nb::handle d_shared_down,
         bool accumulate_weight_grads, std::optional<double> swiglu_limit, nb::handle fp8_weights,
         bool fp8_weight_grads) {
        const Inputs in = inputs_of(x, topk_experts, topk_weights);
        const Weights w =
            weights_of(gate, up, down, shared_gate, shared_up, shared_down, swiglu_limit);
        const ForwardContext c = context_of(x_routed, gate_routed, up_routed, hidden_routed,
                                            gate_shared, up_shared, hidden_shared);
        const TensorView g_out = view_of(d_out, "d_out");
        const Grads g = grads_of(d_x, d_topk_weights, d_gate, d_up, d_down, d_shared_gate,
                                 d_shared_up, d_shared_down);
        BackwardOptions options;
        options.accumulate_weight_grads = accumulate_weight_grads;
        options.fp8_weight_grads = fp8_weight_grads;
        const std::optional<Fp8Weights> q = fp8_weights_of(fp8_weights);
        nb::gil_scoped_release release;
        if (q) {
          backward(ws, in, w, *q, c, g_out, g, options);
        } else {
          backward(ws, in, w, c, g_out, g, options);
        }
      },
      nb::arg("workspace"), nb::arg("x"), nb::arg("topk_experts"), nb::arg("topk_weights"),
      nb::arg("routed_gate_weights"), nb::arg("routed_up_weights"), nb::arg("routed_down_weights"),
      nb::arg("shared_gate_weights").none(), nb::arg("shared_up_weights").none(),
      nb::arg("shared_down_weights").none(), nb::arg("x_routed"), nb::arg("gate_routed"),
      nb::arg("up_routed"), nb::arg("hidden_routed"), nb::arg("gate_shared").none(),
      nb::arg("up_shared").none(), nb::arg("hidden_shared").none(), nb::arg("d_out"),
      nb::arg("d_x"), nb::arg("d_topk_weights"), nb::arg("d_routed_gate_weights"),
      nb::arg("d_routed_up_weights"), nb::arg("d_routed_down_weights"),
      nb::arg("d_shared_gate_weights").none(), nb::arg("d_shared_up_weights").none(),
      nb::arg("d_shared_down_weights").none(), nb::arg("accumulate_weight_grads") = false,
      nb::arg("swiglu_limit").none() = nb::none(), nb::arg("fp8_weights").none() = nb::none(),
      nb::arg("fp8_weight_grads") = true);
  // mok's weight quantizer and MoK's MX-to-blocks conversion (include/mok/fp8.hpp), for the FP8
  // layer's weights (mok/_fp8_layer.py): views in; on CUDA one launch on `stream`.
  m.def(
      "quantize_weights",
      [](nb::handle w, nb::handle data, nb::handle scales, nb::handle data_t, nb::handle scales_t,
         std::uintptr_t stream) {
        const TensorView wv = view_of(w, "w");
        const QuantizedWeights q{view_of(data, "out.data"), view_of(scales, "out.scales"),
                                 view_of(data_t, "out.data_t"), view_of(scales_t, "out.scales_t")};
        nb::gil_scoped_release release;
        quantize_weights(wv, q, reinterpret_cast<void*>(stream));
      },
      nb::arg("w"), nb::arg("data"), nb::arg("scales"), nb::arg("data_t"), nb::arg("scales_t"),
      nb::arg("stream"));
  m.def(
      "mx_weights_to_blocks",
      [](nb::handle data, nb::handle scales, nb::handle out_data, nb::handle out_scales,
         nb::handle out_data_t, nb::handle out_scales_t, nb::handle inexact_count,
         std::uintptr_t stream) {
        const TensorView dv = view_of(data, "data"), sv = view_of(scales, "scales"),
                         cv = view_of(inexact_count, "inexact_count");
        const QuantizedWeights q{view_of(out_data, "out.data"), view_of(out_scales, "out.scales"),
                                 view_of(out_data_t, "out.data_t"),
                                 view_of(out_scales_t, "out.scales_t")};
        nb::gil_scoped_release release;
        mx_weights_to_blocks(dv, sv, q, cv, reinterpret_cast<void*>(stream));
      },
      nb::arg("data"), nb::arg("scales"), nb::arg("out_data"), nb::arg("out_scales"),
      nb::arg("out_data_t"), nb::arg("out_scales_t"), nb::arg("inexact_count"), nb::arg("stream"));
  // MoK's mxfp8_quantize (mok/_fp8.py, include/mok/fp8.hpp): views in (an absent output pair is
  // not computed); on CUDA one launch on `stream`, on the CPU the reference.
  m.def(
      "mxfp8_quantize",
      [](nb::handle x, nb::handle x_fp8, nb::handle x_sc, nb::handle x_fp8_t, nb::handle x_sc_t,
         std::uintptr_t stream) {
        const TensorView xv = view_of(x, "x_bf16"), q = view_of(x_fp8, "x_fp8"),
                         s = view_of(x_sc, "x_sc"), qt = view_of(x_fp8_t, "x_fp8_t"),
                         st = view_of(x_sc_t, "x_sc_t");
        nb::gil_scoped_release release;
        mxfp8_quantize(xv, q, s, qt, st, reinterpret_cast<void*>(stream));
      },
      nb::arg("x").none(), nb::arg("x_fp8").none(), nb::arg("x_sc").none(),
      nb::arg("x_fp8_t").none(), nb::arg("x_sc_t").none(), nb::arg("stream"));
  // Host expert parallelism (include/mok/host_ep.hpp): the expert and home halves of each call;
  // mok/_host_ep.py moves the rows between ranks. Gathered views are every rank's tensor in rank
  // order; optional buffers are None (recompute: no combine rows, no out).
  m.def(
      "check_expert_ids_all_ranks",
      [](nb::handle topk_experts_all, std::int64_t num_experts, int ep_size) {
        const TensorView v = view_of(topk_experts_all, "topk_experts_all");
        if (v.ndim != 2) throw Error("topk_experts_all.ndim", "2", to_text(v.ndim));
        if (ep_size < 1 || v.shape[0] % ep_size != 0) {
          throw Error("topk_experts_all.shape[0]", "a multiple of ep_size = " + to_text(ep_size),
                      to_text(v.shape[0]));
        }
        check_view("topk_experts_all", v, DType::i64, {v.shape[0], v.shape[1]}, Device{});
        Problem p;
        p.num_tokens = v.shape[0] / ep_size;
        p.topk = v.shape[1];
        p.num_experts = num_experts;
        p.ep_size = ep_size;
        nb::gil_scoped_release release;
        check_expert_ids_all_ranks(p, v);
      },
      nb::arg("topk_experts_all"), nb::arg("num_experts"), nb::arg("ep_size"));
  m.def(
      "host_ep_counts",
      [](Workspace& ws, nb::handle topk_experts_all) {
        const TensorView v = view_of(topk_experts_all, "topk_experts_all");
        host_ep::ExchangeCounts c;
        {
          nb::gil_scoped_release release;
          c = host_ep::exchange_counts(ws, v);
        }
        return nb::make_tuple(c.send, c.receive);
      },
      nb::arg("workspace"), nb::arg("topk_experts_all"));
  m.def(
      "host_ep_expert_forward",
      [](Workspace& ws, nb::handle x_all, nb::handle topk_experts_all, nb::handle gate,
         nb::handle up, nb::handle down, nb::handle shared_gate, nb::handle shared_up,
         nb::handle shared_down, nb::handle combine_send, nb::handle x_routed,
         nb::handle gate_routed, nb::handle up_routed, nb::handle hidden_routed,
         nb::handle gate_shared, nb::handle up_shared, nb::handle hidden_shared,
         std::optional<double> swiglu_limit, nb::handle fp8_weights) {
        const Inputs in{view_of(x_all, "x_all"), view_of(topk_experts_all, "topk_experts_all"),
                        TensorView{}};
        const Weights w =
            weights_of(gate, up, down, shared_gate, shared_up, shared_down, swiglu_limit);
        const TensorView send = view_of(combine_send, "combine_send");
        ForwardContext c = context_of(x_routed, gate_routed, up_routed, hidden_routed, gate_shared,
                                      up_shared, hidden_shared);
        const std::optional<Fp8Weights> q = fp8_weights_of(fp8_weights);
        nb::gil_scoped_release release;
        if (q) {
          host_ep::expert_forward(ws, in, w, *q, send, c);
        } else {
          host_ep::expert_forward(ws, in, w, send, c);
        }
      },
      nb::arg("workspace"), nb::arg("x_all"), nb::arg("topk_experts_all"),
      nb::arg("routed_gate_weights"), nb::arg("routed_up_weights"),
      nb::arg("routed_down_weights").none(), nb::arg("shared_gate_weights").none(),
      nb::arg("shared_up_weights").none(), nb::arg("shared_down_weights").none(),
      nb::arg("combine_send").none(), nb::arg("x_routed"), nb::arg("gate_routed"),
      nb::arg("up_routed"), nb::arg("hidden_routed"), nb::arg("gate_shared").none(),
      nb::arg("up_shared").none(), nb::arg("hidden_shared").none(),
      nb::arg("swiglu_limit").none() = nb::none(), nb::arg("fp8_weights").none() = nb::none());
  m.def(
      "host_ep_home_forward",
      [](Workspace& ws, nb::handle x, nb::handle topk_experts, nb::handle topk_weights,
         nb::handle gate, nb::handle up, nb::handle down, nb::handle shared_gate,
         nb::handle shared_up, nb::handle shared_down, nb::handle combine_received, nb::handle out,
         nb::handle x_routed, nb::handle gate_routed, nb::handle up_routed,
         nb::handle hidden_routed, nb::handle gate_shared, nb::handle up_shared,
         nb::handle hidden_shared, std::optional<double> swiglu_limit) {
        const Inputs in = inputs_of(x, topk_experts, topk_weights);
        const Weights w =
            weights_of(gate, up, down, shared_gate, shared_up, shared_down, swiglu_limit);
        const TensorView received = view_of(combine_received, "combine_received");
        const TensorView o = view_of(out, "out");
        ForwardContext c = context_of(x_routed, gate_routed, up_routed, hidden_routed, gate_shared,
                                      up_shared, hidden_shared);
        nb::gil_scoped_release release;
        host_ep::home_forward(ws, in, w, received, o, c);
      },
      nb::arg("workspace"), nb::arg("x"), nb::arg("topk_experts"), nb::arg("topk_weights").none(),
      nb::arg("routed_gate_weights"), nb::arg("routed_up_weights"),
      nb::arg("routed_down_weights").none(), nb::arg("shared_gate_weights").none(),
      nb::arg("shared_up_weights").none(), nb::arg("shared_down_weights").none(),
      nb::arg("combine_received").none(), nb::arg("out").none(), nb::arg("x_routed"),
      nb::arg("gate_routed"), nb::arg("up_routed"), nb::arg("hidden_routed"),
      nb::arg("gate_shared").none(), nb::arg("up_shared").none(), nb::arg("hidden_shared").none(),
      nb::arg("swiglu_limit").none() = nb::none());
  m.def(
      "host_ep_expert_backward",
      [](Workspace& ws, nb::handle x_all, nb::handle topk_experts_all, nb::handle topk_weights_all,
         nb::handle gate, nb::handle up, nb::handle down, nb::handle shared_gate,
         nb::handle shared_up, nb::handle shared_down, nb::handle x_routed, nb::handle gate_routed,
         nb::handle up_routed, nb::handle hidden_routed, nb::handle gate_shared,
         nb::handle up_shared, nb::handle hidden_shared, nb::handle d_out_all, nb::handle dx_send,
         nb::handle dw_send, nb::handle d_x, nb::handle d_topk_weights, nb::handle d_gate,
         nb::handle d_up, nb::handle d_down, nb::handle d_shared_gate, nb::handle d_shared_up,
         nb::handle d_shared_down, bool accumulate_weight_grads, std::optional<double> swiglu_limit,
         nb::handle fp8_weights, bool fp8_weight_grads) {
        const Inputs in{view_of(x_all, "x_all"), view_of(topk_experts_all, "topk_experts_all"),
                        view_of(topk_weights_all, "topk_weights_all")};
        const Weights w =
            weights_of(gate, up, down, shared_gate, shared_up, shared_down, swiglu_limit);
        const ForwardContext c = context_of(x_routed, gate_routed, up_routed, hidden_routed,
                                            gate_shared, up_shared, hidden_shared);
        const TensorView g_out = view_of(d_out_all, "d_out_all"), dx = view_of(dx_send, "dx_send"),
                         dw = view_of(dw_send, "dw_send");
        const Grads g = grads_of(d_x, d_topk_weights, d_gate, d_up, d_down, d_shared_gate,
                                 d_shared_up, d_shared_down);
        BackwardOptions options;
        options.accumulate_weight_grads = accumulate_weight_grads;
        options.fp8_weight_grads = fp8_weight_grads;
        const std::optional<Fp8Weights> q = fp8_weights_of(fp8_weights);
        nb::gil_scoped_release release;
        if (q) {
          host_ep::expert_backward(ws, in, w, *q, c, g_out, dx, dw, g, options);
        } else {
          host_ep::expert_backward(ws, in, w, c, g_out, dx, dw, g, options);
        }
      },
      nb::arg("workspace"), nb::arg("x_all"), nb::arg("topk_experts_all"),
      nb::arg("topk_weights_all"), nb::arg("routed_gate_weights"), nb::arg("routed_up_weights"),
      nb::arg("routed_down_weights"), nb::arg("shared_gate_weights").none(),
      nb::arg("shared_up_weights").none(), nb::arg("shared_down_weights").none(),
      nb::arg("x_routed"), nb::arg("gate_routed"), nb::arg("up_routed"), nb::arg("hidden_routed"),
      nb::arg("gate_shared").none(), nb::arg("up_shared").none(), nb::arg("hidden_shared").none(),
      nb::arg("d_out_all"), nb::arg("dx_send"), nb::arg("dw_send"), nb::arg("d_x"),
      nb::arg("d_topk_weights"), nb::arg("d_routed_gate_weights"), nb::arg("d_routed_up_weights"),
      nb::arg("d_routed_down_weights"), nb::arg("d_shared_gate_weights").none(),
      nb::arg("d_shared_up_weights").none(), nb::arg("d_shared_down_weights").none(),
      nb::arg("accumulate_weight_grads") = false, nb::arg("swiglu_limit").none() = nb::none(),
      nb::arg("fp8_weights").none() = nb::none(), nb::arg("fp8_weight_grads") = true);
  m.def(
      "host_ep_home_backward",
      [](Workspace& ws, nb::handle x, nb::handle topk_experts, nb::handle topk_weights,
         nb::handle gate, nb::handle up, nb::handle down, nb::handle shared_gate,
         nb::handle shared_up, nb::handle shared_down, nb::handle x_routed, nb::handle gate_routed,
         nb::handle up_routed, nb::handle hidden_routed, nb::handle gate_shared,
         nb::handle up_shared, nb::handle hidden_shared, nb::handle d_out, nb::handle dx_received,
         nb::handle dw_received, nb::handle d_x, nb::handle d_topk_weights, nb::handle d_gate,
         nb::handle d_up, nb::handle d_down, nb::handle d_shared_gate, nb::handle d_shared_up,
         nb::handle d_shared_down, bool accumulate_weight_grads,
         std::optional<double> swiglu_limit) {
        const Inputs in = inputs_of(x, topk_experts, topk_weights);
        const Weights w =
            weights_of(gate, up, down, shared_gate, shared_up, shared_down, swiglu_limit);
        const ForwardContext c = context_of(x_routed, gate_routed, up_routed, hidden_routed,
                                            gate_shared, up_shared, hidden_shared);
        const TensorView g_out = view_of(d_out, "d_out"), dx = view_of(dx_received, "dx_received"),
                         dw = view_of(dw_received, "dw_received");
        const Grads g = grads_of(d_x, d_topk_weights, d_gate, d_up, d_down, d_shared_gate,
                                 d_shared_up, d_shared_down);
        BackwardOptions options;
        options.accumulate_weight_grads = accumulate_weight_grads;
        nb::gil_scoped_release release;
        host_ep::home_backward(ws, in, w, c, g_out, dx, dw, g, options);
      },
      nb::arg("workspace"), nb::arg("x"), nb::arg("topk_experts"), nb::arg("topk_weights"),
      nb::arg("routed_gate_weights"), nb::arg("routed_up_weights"), nb::arg("routed_down_weights"),
      nb::arg("shared_gate_weights").none(), nb::arg("shared_up_weights").none(),
      nb::arg("shared_down_weights").none(), nb::arg("x_routed"), nb::arg("gate_routed"),
      nb::arg("up_routed"), nb::arg("hidden_routed"), nb::arg("gate_shared").none(),
      nb::arg("up_shared").none(), nb::arg("hidden_shared").none(), nb::arg("d_out"),
      nb::arg("dx_received"), nb::arg("dw_received"), nb::arg("d_x"), nb::arg("d_topk_weights"),
      nb::arg("d_routed_gate_weights"), nb::arg("d_routed_up_weights"),
      nb::arg("d_routed_down_weights"), nb::arg("d_shared_gate_weights").none(),
      nb::arg("d_shared_up_weights").none(), nb::arg("d_shared_down_weights").none(),
      nb::arg("accumulate_weight_grads") = false, nb::arg("swiglu_limit").none() = nb::none());
}
