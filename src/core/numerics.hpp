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

// Given dh = d(loss)/d(silu(g) * u): the gradients with respect to g and u.
//   d/dg silu(g) = s * (1 + g * (1 - s)),  s = sigmoid(g)
template <typename Real>
MOK_HOST_DEVICE inline void swiglu_backward(Real g, Real u, Real dh, Real* dg, Real* du) {
  const Real s = sigmoid(g);
  *du = dh * (g * s);
  *dg = dh * u * (s * (Real(1) + g * (Real(1) - s)));
}

}  // namespace mok::numerics
