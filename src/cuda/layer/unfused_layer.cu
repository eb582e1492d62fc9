#include "cuda/layer/unfused_layer.hpp"

#include <algorithm>
#include <vector>

#include "core/schedule_layout.hpp"
#include "cuda/comm/team.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/kernels/finalize_grad.hpp"
#include "cuda/kernels/home_reduce.hpp"
#include "cuda/kernels/pass_segments.hpp"
#include "cuda/kernels/swiglu_backward.hpp"
#include "cuda/kernels/transfer.hpp"
#include "mok/schedule.hpp"

namespace mok::cuda {
namespace {

using bf16 = __nv_bfloat16;

void check(cudaError_t e, const char* what) { mok::cuda_check(e, what); }

// One device allocation carved into 256-byte aligned buffers.
class Arena {
 public:
  // An offset disguised as a pointer, until rebase() adds the allocation's base.
  template <typename T>
  T* take(std::int64_t count) {
    const std::int64_t offset = end_;
    end_ = (end_ + count * static_cast<std::int64_t>(sizeof(T)) + 255) / 256 * 256;
    return reinterpret_cast<T*>(offset);
  }
  std::int64_t bytes() const { return end_; }

 private:
  std::int64_t end_ = 0;
};

template <typename T>
T* rebase(T* offset_ptr, std::uint8_t* base) {
  return reinterpret_cast<T*>(base + reinterpret_cast<std::intptr_t>(offset_ptr));
}

// The buffers of one rank beyond the team's workspace. Pass 0's are the forward context; later
// passes (and backward replays) use the scratch set.
struct RankBuffers {
  struct PassSet {
    bf16 *x = nullptr, *gate = nullptr, *up = nullptr, *hidden = nullptr;
  };
  PassSet context, scratch;
  bf16 *y = nullptr;    // [R, H]: down output (forward), dy (backward)
  bf16 *dh = nullptr;   // [R, I]
  bf16 *dg = nullptr;   // [R, I]
  bf16 *du = nullptr;   // [R, I]
  bf16 *dx = nullptr;   // [R, H]
  std::int32_t *pass_starts = nullptr, *pass_rows = nullptr;  // [E_l + 1], [E_l]
  // shared expert
  bf16 *s_gate = nullptr, *s_up = nullptr, *s_hidden = nullptr;  // [T, S] context
  bf16 *s_out = nullptr;                                          // [T, H]: output, then dx
  bf16 *s_dh = nullptr, *s_dg = nullptr, *s_du = nullptr;         // [T, S]
  // fp32 reductions of the routed weight gradients over several passes (max_passes > 1 only)
  float *acc_gate = nullptr, *acc_up = nullptr, *acc_down = nullptr;
};

}  // namespace

struct UnfusedLayer::Impl {
  Problem problem;
  Config config;
  int device = 0;
  Team team;
  std::int64_t ring = 0;  // R: ring rows
  int passes = 1;
  std::vector<RankBuffers> ranks;
  void* arena = nullptr;
  std::int64_t arena_bytes = 0;
  std::int32_t* dense_rows = nullptr;  // device scalar T: the shared expert's row count
  // Peer-address arrays (device), one entry per rank.
  const void** x_peers = nullptr;
  const void** d_out_peers = nullptr;
  const float** w_peers = nullptr;
  void** combine_peers = nullptr;
  void** dx_peers = nullptr;

  Impl(const Problem& p, const Config& c, int dev)
      : problem(p), config(c), device(dev), team(Team::local_virtual(p, c, {.device_index = dev})) {}
  ~Impl() { cudaFree(arena); }

  const plan::WorkspacePlan& plan() const { return team.impl().plan; }
  std::uint8_t* symmetric(int r) const { return team.impl().symmetric[r]; }
  std::uint8_t* local(int r) const { return team.impl().local[r]; }
  template <typename T>
  T* sym(int r, const plan::Buffer& b) const { return reinterpret_cast<T*>(symmetric(r) + b.offset); }
  template <typename T>
  T* loc(int r, const plan::Buffer& b) const { return reinterpret_cast<T*>(local(r) + b.offset); }

  const std::int32_t* table(int r) const { return loc<std::int32_t>(r, plan().schedule_table); }
  const std::int32_t* total_rows(int r) const {
    // RingPlan's first field is total_rows (schedule_layout.hpp).
    return loc<std::int32_t>(r, plan().ring_plan);
  }
  RowGeometry geometry() const {
    return {problem.num_tokens, problem.topk, problem.hidden_size, problem.ep_size};
  }
  PassRows pass_rows(int r, int pass) const {
    return {table(r), total_rows(r), std::int64_t{pass} * config.macrobatch_size, ring};
  }
  gemm::RowSegments pass_segments(int r) const {
    return {ranks[r].pass_starts, ranks[r].pass_rows,
            static_cast<int>(problem.num_local_experts()), static_cast<int>(ring), 0};
  }
  gemm::RowSegments dense_segments() const {
    const int T = static_cast<int>(problem.num_tokens);
    return {nullptr, nullptr, 1, T, T};
  }

  void compute_pass_segments(int r, int pass, cudaStream_t s) {
    PassSegmentsParams p{loc<std::int32_t>(r, plan().segment_starts),
                         loc<std::int32_t>(r, plan().expert_counts),
                         static_cast<std::int32_t>(problem.num_local_experts()),
                         std::int64_t{pass} * config.macrobatch_size, ring, ranks[r].pass_starts,
                         ranks[r].pass_rows};
    check(launch_pass_segments(p, s), "pass segments");
  }

  // Dispatch of x and gate/up + SwiGLU for pass `pass` of rank r into `set`.
  void gate_up_pass(int r, int pass, const RankTensors& t, const RankBuffers::PassSet& set,
                    cudaStream_t s) {
    const std::int64_t H = problem.hidden_size, I = problem.intermediate_size;
    PullParams pull{pass_rows(r, pass), geometry(), x_peers, nullptr, set.x};
    check(launch_pull_rows(pull, s), "dispatch of x");
    gemm::GateUpForwardArgs g;
    g.segments = pass_segments(r);
    g.x = set.x;
    g.ld_x = H;
    g.w_gate = t.w.gate.ptr<const bf16>();
    g.w_up = t.w.up.ptr<const bf16>();
    g.hidden = set.hidden;
    g.gate = set.gate;
    g.up = set.up;
    g.ld_out = I;
    g.hidden_size = static_cast<int>(H);
    g.intermediate_size = static_cast<int>(I);
    g.stream = s;
    gemm::gate_up_forward(g);
  }
};

UnfusedLayer::UnfusedLayer(const Problem& p, const Config& config, int device)
    : impl_(std::make_unique<Impl>(p, config, device)) {
  Impl& m = *impl_;
  check(cudaSetDevice(device), "cudaSetDevice");
  const std::int64_t W = p.ep_size, T = p.num_tokens, H = p.hidden_size,
                     I = p.intermediate_size, S = p.shared_intermediate_size,
                     E = p.num_local_experts();
  const std::int64_t max_rows = schedule_capacity_rows(p);
  // NOTES: the ring never needs more rows than the worst-case table, rounded to whole minibatches
  // (so passes keep their alignment); the Config's macrobatch_size only caps it.
  m.ring = std::min<std::int64_t>(
      config.macrobatch_size,
      schedule::round_up(max_rows, config.minibatch_size));
  m.passes = static_cast<int>((max_rows + config.macrobatch_size - 1) / config.macrobatch_size);

  Arena a;
  m.ranks.resize(W);
  for (auto& b : m.ranks) {
    for (RankBuffers::PassSet* set : {&b.context, &b.scratch}) {
      if (set == &b.scratch && m.passes == 1) {  // one pass: backward never replays
        continue;
      }
      set->x = a.take<bf16>(m.ring * H);
      set->gate = a.take<bf16>(m.ring * I);
      set->up = a.take<bf16>(m.ring * I);
      set->hidden = a.take<bf16>(m.ring * I);
    }
    b.y = a.take<bf16>(m.ring * H);
    b.dh = a.take<bf16>(m.ring * I);
    b.dg = a.take<bf16>(m.ring * I);
    b.du = a.take<bf16>(m.ring * I);
    b.dx = a.take<bf16>(m.ring * H);
    b.pass_starts = a.take<std::int32_t>(E + 1);
    b.pass_rows = a.take<std::int32_t>(E);
    if (S > 0) {
      b.s_gate = a.take<bf16>(T * S);
      b.s_up = a.take<bf16>(T * S);
      b.s_hidden = a.take<bf16>(T * S);
      b.s_out = a.take<bf16>(T * H);
      b.s_dh = a.take<bf16>(T * S);
      b.s_dg = a.take<bf16>(T * S);
      b.s_du = a.take<bf16>(T * S);
    }
    if (m.passes > 1) {
      b.acc_gate = a.take<float>(E * I * H);
      b.acc_up = a.take<float>(E * I * H);
      b.acc_down = a.take<float>(E * H * I);
    }
  }
  std::int32_t* dense_rows = a.take<std::int32_t>(1);
  auto* x_peers = a.take<const void*>(W);
  auto* d_out_peers = a.take<const void*>(W);
  auto* w_peers = a.take<const float*>(W);
  auto* combine_peers = a.take<void*>(W);
  auto* dx_peers = a.take<void*>(W);

  m.arena_bytes = a.bytes();
  check(cudaMalloc(&m.arena, m.arena_bytes), "cudaMalloc of the layer buffers");
  auto* base = static_cast<std::uint8_t*>(m.arena);
  // Every field below was set by take() as an offset (the first one is 0): rebase them all.
  auto place = [&](auto*& ptr) { ptr = rebase(ptr, base); };
  for (auto& b : m.ranks) {
    for (RankBuffers::PassSet* set : {&b.context, &b.scratch}) {
      if (set == &b.scratch && m.passes == 1) continue;
      place(set->x), place(set->gate), place(set->up), place(set->hidden);
    }
    place(b.y), place(b.dh), place(b.dg), place(b.du), place(b.dx);
    place(b.pass_starts), place(b.pass_rows);
    if (S > 0) {
      place(b.s_gate), place(b.s_up), place(b.s_hidden), place(b.s_out);
      place(b.s_dh), place(b.s_dg), place(b.s_du);
    }
    if (m.passes > 1) place(b.acc_gate), place(b.acc_up), place(b.acc_down);
  }
  m.dense_rows = rebase(dense_rows, base);
  m.x_peers = rebase(x_peers, base);
  m.d_out_peers = rebase(d_out_peers, base);
  m.w_peers = rebase(w_peers, base);
  m.combine_peers = rebase(combine_peers, base);
  m.dx_peers = rebase(dx_peers, base);

  const plan::WorkspacePlan& pl = m.plan();
  std::vector<const void*> xs, ds;
  std::vector<const float*> ws;
  std::vector<void*> cs, dxs;
  for (int r = 0; r < W; ++r) {
    xs.push_back(m.symmetric(r) + pl.x_staging.offset);
    ds.push_back(m.symmetric(r) + pl.d_out_staging.offset);
    ws.push_back(reinterpret_cast<const float*>(m.symmetric(r) + pl.router_weights.offset));
    cs.push_back(m.symmetric(r) + pl.combine.offset);
    dxs.push_back(m.symmetric(r) + pl.dx_routed.offset);
  }
  const std::int32_t rows = static_cast<std::int32_t>(T);
  check(cudaMemcpy(m.dense_rows, &rows, sizeof rows, cudaMemcpyHostToDevice), "upload");
  check(cudaMemcpy(m.x_peers, xs.data(), W * sizeof(void*), cudaMemcpyHostToDevice), "upload");
  check(cudaMemcpy(m.d_out_peers, ds.data(), W * sizeof(void*), cudaMemcpyHostToDevice), "upload");
  check(cudaMemcpy(m.w_peers, ws.data(), W * sizeof(void*), cudaMemcpyHostToDevice), "upload");
  check(cudaMemcpy(m.combine_peers, cs.data(), W * sizeof(void*), cudaMemcpyHostToDevice), "upload");
  check(cudaMemcpy(m.dx_peers, dxs.data(), W * sizeof(void*), cudaMemcpyHostToDevice), "upload");
}

UnfusedLayer::~UnfusedLayer() = default;

std::int64_t UnfusedLayer::ring_rows() const { return impl_->ring; }
int UnfusedLayer::max_passes() const { return impl_->passes; }
std::size_t UnfusedLayer::bytes() const {
  const auto& t = impl_->team.impl();
  return static_cast<std::size_t>(impl_->arena_bytes + t.allocation_bytes);
}
void UnfusedLayer::check_errors() { impl_->team.check_errors(); }

void UnfusedLayer::forward(std::span<const RankTensors> ranks, bool write_output,
                           cudaStream_t s) {
  Impl& m = *impl_;
  const Problem& p = m.problem;
  const std::int64_t T = p.num_tokens, H = p.hidden_size, k = p.topk, S = p.shared_intermediate_size;
  const int W = p.ep_size;
  const plan::WorkspacePlan& pl = m.plan();

  // Stage every rank's x and router weights in its symmetric region (peers pull from there).
  std::vector<TensorView> ids;
  for (int r = 0; r < W; ++r) {
    check(cudaMemcpyAsync(m.sym<void>(r, pl.x_staging), ranks[r].in.x.data, T * H * 2,
                          cudaMemcpyDeviceToDevice, s), "staging x");
    check(cudaMemcpyAsync(m.sym<void>(r, pl.router_weights), ranks[r].in.topk_weights.data,
                          T * k * 4, cudaMemcpyDeviceToDevice, s), "staging router weights");
    ids.push_back(ranks[r].in.topk_experts);
  }
  build_schedule(m.team, ids, {.stream = s});

  // Shared expert first (DESIGN.md section 4: it hides the first dispatch in the megakernel).
  for (int r = 0; r < W && S > 0; ++r) {
    RankBuffers& b = m.ranks[r];
    gemm::GateUpForwardArgs g;
    g.segments = m.dense_segments();
    g.x = ranks[r].in.x.ptr<const bf16>();
    g.ld_x = H;
    g.w_gate = ranks[r].w.shared_gate.ptr<const bf16>();
    g.w_up = ranks[r].w.shared_up.ptr<const bf16>();
    g.hidden = b.s_hidden;
    g.gate = b.s_gate;
    g.up = b.s_up;
    g.ld_out = S;
    g.hidden_size = static_cast<int>(H);
    g.intermediate_size = static_cast<int>(S);
    g.stream = s;
    gemm::gate_up_forward(g);
    if (!write_output) continue;  // only `out` needs the shared expert's output
    gemm::RowsTimesWeightTArgs d;
    d.segments = m.dense_segments();
    d.a = b.s_hidden;
    d.ld_a = S;
    d.w = ranks[r].w.shared_down.ptr<const bf16>();
    d.out = b.s_out;
    d.ld_out = H;
    d.n = static_cast<int>(H);
    d.k = static_cast<int>(S);
    d.stream = s;
    gemm::rows_times_weight_t(d);
  }

  for (int pass = 0; pass < m.passes; ++pass) {
    for (int r = 0; r < W; ++r) {
      RankBuffers& b = m.ranks[r];
      const RankBuffers::PassSet& set = pass == 0 ? b.context : b.scratch;
      m.compute_pass_segments(r, pass, s);
      m.gate_up_pass(r, pass, ranks[r], set, s);
      // NOTES: recompute_forward_context runs the down GEMM and the combine too: backward takes
      // d_w = <d_out, y> from the expert outputs in `combine`.
      gemm::RowsTimesWeightTArgs d;
      d.segments = m.pass_segments(r);
      d.a = set.hidden;
      d.ld_a = p.intermediate_size;
      d.w = ranks[r].w.down.ptr<const bf16>();
      d.out = b.y;
      d.ld_out = H;
      d.n = static_cast<int>(H);
      d.k = static_cast<int>(p.intermediate_size);
      d.stream = s;
      gemm::rows_times_weight_t(d);
      PushParams push{m.pass_rows(r, pass), m.geometry(), b.y, m.combine_peers};
      check(launch_push_rows(push, s), "combine");
    }
  }
  if (!write_output) return;
  for (int r = 0; r < W; ++r) {
    HomeReduceParams h{T, k, H, p.num_experts, ranks[r].in.topk_experts.ptr<const std::int64_t>(),
                       ranks[r].in.topk_weights.ptr<const float>(), m.sym<const void>(r, pl.combine),
                       S > 0 ? m.ranks[r].s_out : nullptr, ranks[r].out.data};
    check(launch_combine_reduce(h, s), "home reduction of out");
  }
}

namespace {

// A weight gradient into the caller's view: fp32 views take the reduction directly (adding to
// it when asked); bf16 views get one rounding at the end.
struct GradTarget {
  void* out;
  bool out_fp32;
  bool accumulate;
};

GradTarget target_of(const TensorView& v, bool accumulate) {
  return {v.data, v.dtype == DType::f32, accumulate && v.dtype == DType::f32};
}

}  // namespace

void UnfusedLayer::backward(std::span<const RankTensors> ranks, const BackwardOptions& options,
                            cudaStream_t s) {
  Impl& m = *impl_;
  const Problem& p = m.problem;
  const std::int64_t T = p.num_tokens, H = p.hidden_size, I = p.intermediate_size, k = p.topk,
                     S = p.shared_intermediate_size, E = p.num_local_experts();
  const int W = p.ep_size;
  const plan::WorkspacePlan& pl = m.plan();

  for (int r = 0; r < W; ++r) {
    check(cudaMemcpyAsync(m.sym<void>(r, pl.d_out_staging), ranks[r].d_out.data, T * H * 2,
                          cudaMemcpyDeviceToDevice, s), "staging d_out");
    // d_w at home, from the forward's expert outputs still in `combine`.
    RouterGradParams rg{T, k, H, p.num_experts, ranks[r].in.topk_experts.ptr<const std::int64_t>(),
                        ranks[r].d_out.data, m.sym<const void>(r, pl.combine),
                        ranks[r].grads.d_topk_weights.ptr<float>()};
    check(launch_router_grad(rg, s), "router weight gradient");
  }

  // Shared expert (dense): dh, SwiGLU backward, dx, three weight gradients.
  for (int r = 0; r < W && S > 0; ++r) {
    RankBuffers& b = m.ranks[r];
    const RankTensors& t = ranks[r];
    gemm::RowsTimesWeightArgs dh;
    dh.segments = m.dense_segments();
    dh.a = t.d_out.ptr<const bf16>();
    dh.ld_a = H;
    dh.w = t.w.shared_down.ptr<const bf16>();
    dh.out = b.s_dh;
    dh.ld_out = S;
    dh.n = static_cast<int>(S);
    dh.k = static_cast<int>(H);
    dh.stream = s;
    gemm::rows_times_weight(dh);
    SwigluBackwardParams sb{m.dense_rows, 0, T, S, b.s_dh, b.s_gate, b.s_up, b.s_dg, b.s_du};
    check(launch_swiglu_backward(sb, s), "shared SwiGLU backward");
    gemm::RowsTimesWeightArgs dx;
    dx.segments = m.dense_segments();
    dx.a = b.s_dg;
    dx.ld_a = S;
    dx.w = t.w.shared_gate.ptr<const bf16>();
    dx.a2 = b.s_du;
    dx.ld_a2 = S;
    dx.w2 = t.w.shared_up.ptr<const bf16>();
    dx.out = b.s_out;  // the shared expert's d_x
    dx.ld_out = H;
    dx.n = static_cast<int>(H);
    dx.k = static_cast<int>(S);
    dx.stream = s;
    gemm::rows_times_weight(dx);
    auto wgrad = [&](const bf16* a, std::int64_t m_, const bf16* bm, std::int64_t n_,
                     const TensorView& out) {
      const GradTarget g = target_of(out, options.accumulate_weight_grads);
      gemm::WeightGradArgs w;
      w.segments = m.dense_segments();
      w.a = a;
      w.ld_a = m_;
      w.b = bm;
      w.ld_b = n_;
      w.out = g.out;
      w.ld_out = n_;
      w.out_fp32 = g.out_fp32;
      w.accumulate = g.accumulate;  // main-grad: out + the fresh sum
      w.m = static_cast<int>(m_);
      w.n = static_cast<int>(n_);
      w.stream = s;
      gemm::weight_grad(w);
    };
    wgrad(t.d_out.ptr<const bf16>(), H, b.s_hidden, S, t.grads.d_shared_down);
    wgrad(b.s_dg, S, t.in.x.ptr<const bf16>(), H, t.grads.d_shared_gate);
    wgrad(b.s_du, S, t.in.x.ptr<const bf16>(), H, t.grads.d_shared_up);
  }

  for (int pass = 0; pass < m.passes; ++pass) {
    for (int r = 0; r < W; ++r) {
      RankBuffers& b = m.ranks[r];
      const RankTensors& t = ranks[r];
      const RankBuffers::PassSet& set = pass == 0 ? b.context : b.scratch;
      m.compute_pass_segments(r, pass, s);
      if (pass > 0) m.gate_up_pass(r, pass, t, set, s);  // replay: only pass 0 was kept
      // dy = bf16(w * d_out), pulled from the home ranks.
      PullParams pull{m.pass_rows(r, pass), m.geometry(), m.d_out_peers, m.w_peers, b.y};
      check(launch_pull_rows(pull, s), "dispatch of d_out");
      gemm::RowsTimesWeightArgs dh;
      dh.segments = m.pass_segments(r);
      dh.a = b.y;
      dh.ld_a = H;
      dh.w = t.w.down.ptr<const bf16>();
      dh.out = b.dh;
      dh.ld_out = I;
      dh.n = static_cast<int>(I);
      dh.k = static_cast<int>(H);
      dh.stream = s;
      gemm::rows_times_weight(dh);
      SwigluBackwardParams sb{m.total_rows(r), std::int64_t{pass} * m.config.macrobatch_size,
                              m.ring, I, b.dh, set.gate, set.up, b.dg, b.du};
      check(launch_swiglu_backward(sb, s), "SwiGLU backward");
      gemm::RowsTimesWeightArgs dx;
      dx.segments = m.pass_segments(r);
      dx.a = b.dg;
      dx.ld_a = I;
      dx.w = t.w.gate.ptr<const bf16>();
      dx.a2 = b.du;
      dx.ld_a2 = I;
      dx.w2 = t.w.up.ptr<const bf16>();
      dx.out = b.dx;
      dx.ld_out = H;
      dx.n = static_cast<int>(H);
      dx.k = static_cast<int>(I);
      dx.stream = s;
      gemm::rows_times_weight(dx);
      PushParams push{m.pass_rows(r, pass), m.geometry(), b.dx, m.dx_peers};
      check(launch_push_rows(push, s), "combine of d_x");

      // Routed weight gradients: straight into the caller's view when one pass holds every row;
      // else reduced in fp32 across passes (pass p > 0 continues from the partial sums).
      const bool multi = m.passes > 1;
      auto wgrad = [&](const bf16* a, std::int64_t m_, const bf16* bm, std::int64_t n_,
                       const TensorView& out, float* acc) {
        const GradTarget g = target_of(out, options.accumulate_weight_grads);
        gemm::WeightGradArgs w;
        w.segments = m.pass_segments(r);
        w.a = a;
        w.ld_a = m_;
        w.b = bm;
        w.ld_b = n_;
        w.out = multi ? acc : g.out;
        w.ld_out = n_;
        w.out_fp32 = multi ? true : g.out_fp32;
        w.accumulate = !multi && g.accumulate;
        w.continue_reduction = multi && pass > 0;
        w.m = static_cast<int>(m_);
        w.n = static_cast<int>(n_);
        w.stream = s;
        gemm::weight_grad(w);
        if (multi && pass == m.passes - 1) {
          FinalizeGradParams f{acc, g.out, g.out_fp32, g.accumulate, E * m_ * n_};
          check(launch_finalize_grad(f, s), "weight gradient");
        }
      };
      wgrad(b.y, H, set.hidden, I, t.grads.d_down, b.acc_down);
      wgrad(b.dg, I, set.x, H, t.grads.d_gate, b.acc_gate);
      wgrad(b.du, I, set.x, H, t.grads.d_up, b.acc_up);
    }
  }

  for (int r = 0; r < W; ++r) {
    HomeReduceParams h{T, k, H, p.num_experts, ranks[r].in.topk_experts.ptr<const std::int64_t>(),
                       nullptr, m.sym<const void>(r, pl.dx_routed),
                       S > 0 ? m.ranks[r].s_out : nullptr, ranks[r].grads.d_x.data};
    check(launch_dx_reduce(h, s), "home reduction of d_x");
  }
}

}  // namespace mok::cuda
