// The scalar maths of the layer, shared by every backend so that each one evaluates the same
// expressions: one device function per epilogue and reduction, since two kernels give the same
// bits only if they run the same arithmetic (the compiler may contract a*b+c into an FMA in one
// and not the other).
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define MOK_HOST_DEVICE __host__ __device__
#else
#define MOK_HOST_DEVICE
#endif

namespace mok::numerics {

template <typename Real>
MOK_HOST_DEVICE inline Real sigmoid(Real g) {
  return Real(1) / (Real(1) + exp(-g));
}

// silu(g) * u: the SwiGLU activation of one element.
template <typename Real>
MOK_HOST_DEVICE inline Real swiglu(Real g, Real u) {
  return g * sigmoid(g) * u;
}

#if defined(__CUDACC__)
// sigmoid(g) for the GPU epilogues: exp through ex2.approx and an approximate reciprocal
// (rcp.approx), a relative error of at most ~2^-19 for |g| < 40, against the 2^-9 of the bf16
// results. NOTES: the exact expression costs ~3x the instructions, and the epilogues do not
// overlap the next tile's MMAs (docs/perf/NOTES.md ## gemm, v4). The .ftz forms (what __expf and
// __fdividef compute, without their fix-ups for subnormal results, 3 instructions an element
// saved, v6): exp(-g) below 2^-126 becomes 0, so the result is 1 there, within 2^-126 of the exact
// value; where exp(-g) overflows it is 0, as in the exact form.
__device__ inline float sigmoid_fast(float g) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
}

// The gate/up epilogue's SwiGLU. Limits as the exact form: g -> -inf gives -0 * u, g -> +inf
// gives g * u.
__device__ inline float swiglu_fast(float g, float u) {
  return g * sigmoid_fast(g) * u;
}
#endif

// Given dh = d(loss)/d(silu(g) * u): the gradients with respect to g and u.
//   d/dg silu(g) = s * (1 + g * (1 - s)),  s = sigmoid(g)
template <typename Real>
MOK_HOST_DEVICE inline void swiglu_backward(Real g, Real u, Real dh, Real* dg, Real* du) {
  const Real s = sigmoid(g);
  *du = dh * (g * s);
  *dg = dh * u * (s * (Real(1) + g * (Real(1) - s)));
}

#if defined(__CUDACC__)
// The down dgrad epilogue's SwiGLU backward: swiglu_backward with sigmoid_fast.
__device__ inline void swiglu_backward_fast(float g, float u, float dh, float* dg, float* du) {
  const float s = sigmoid_fast(g);
  *du = dh * (g * s);
  *dg = dh * u * (s * (1.0f + g * (1.0f - s)));
}
#endif

// Clamped SwiGLU (`swiglu_limit`, MoK's semantics, as DeepSeek-V4-style models use it), L > 0
// finite. MoK clamps the gate from above only and the up projection on both sides, before the
// SiLU, and keeps g and u themselves unclamped in the forward context (backward clamps again):
//   gc = min(g, L)           uc = min(max(u, -L), L)
//   h  = silu(gc) * uc
// Gradients, as torch.clamp's (the derivative of the clamp is 1 on the closed interval, the
// boundary included, and 0 outside it):
//   dg = g <= L        ? dh * uc * silu'(gc) : 0      silu'(x) = s (1 + x (1 - s)), s = sigmoid(x)
//   du = -L <= u <= L  ? dh * silu(gc)       : 0
// (Inside the interval gc = g and uc = u: the unclamped expressions.) min and max are fmin and
// fmax: a NaN g or u takes the limit, as in MoK's kernels, and its gradient is 0 (the comparison
// is false). Read in MoK's csrc/megakernel/swiglu.cuh (swiglu_bwd_pair, swiglu_fwd_kernel) and
// its test reference tests/utils.py (run_swiglu_reference: clamp(max=L) on the gate,
// clamp(-L, L) on up, autograd for the backward). The limit is an fp32 value everywhere (MoK's
// kernels take a float); the f64 reference compares against the same value.
template <typename Real>
MOK_HOST_DEVICE inline Real clamp_gate(Real g, Real limit) {
  return fmin(g, limit);
}
template <typename Real>
MOK_HOST_DEVICE inline Real clamp_up(Real u, Real limit) {
  return fmin(fmax(u, -limit), limit);
}

template <typename Real>
MOK_HOST_DEVICE inline Real swiglu_clamped(Real g, Real u, Real limit) {
  return swiglu(clamp_gate(g, limit), clamp_up(u, limit));
}

template <typename Real>
MOK_HOST_DEVICE inline void swiglu_backward_clamped(Real g, Real u, Real dh, Real limit, Real* dg,
                                                    Real* du) {
  Real a, b;
  swiglu_backward(clamp_gate(g, limit), clamp_up(u, limit), dh, &a, &b);
  *dg = g <= limit ? a : Real(0);
  *du = (u >= -limit && u <= limit) ? b : Real(0);
}

#if defined(__CUDACC__)
// The epilogues' forms of the two above (sigmoid_fast); the unclamped epilogues call
// swiglu_fast / swiglu_backward_fast, untouched.
__device__ inline float swiglu_clamped_fast(float g, float u, float limit) {
  return swiglu_fast(fminf(g, limit), fminf(fmaxf(u, -limit), limit));
}

__device__ inline void swiglu_backward_clamped_fast(float g, float u, float dh, float limit,
                                                    float* dg, float* du) {
  float a, b;
  swiglu_backward_fast(fminf(g, limit), fminf(fmaxf(u, -limit), limit), dh, &a, &b);
  *dg = g <= limit ? a : 0.0f;
  *du = (u >= -limit && u <= limit) ? b : 0.0f;
}
#endif

}  // namespace mok::numerics
