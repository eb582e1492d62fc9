// The scalar maths of the layer, shared by every backend so that each one evaluates the same
// expressions (DESIGN.md section 8: one device function per epilogue and reduction).
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

}  // namespace mok::numerics
