// The library's e4m3 instantiations of the standalone grouped GEMM kernel
// (sm90_grouped_gemm.cuh, the same kernel over Form<kind, Operand::e4m3>): the (form,
// epilogue) pairs gate_up_forward_fp8 and rows_times_weight_t_fp8 pick (src/cuda/gemm/launch.cu),
// for each mainloop (the launchers' `pairs`, `overlap` and `wide`), and the gate/up epilogue that
// quantizes hidden (::hidden_quantized, wide tiles only).
#include "cuda/kernels/sm90_grouped_gemm.cuh"

namespace mok::gemm {

using epilogue::RowsBf16;
using epilogue::SwigluForward;
using Stream = cudaStream_t;
using Scales = const Fp8Params&;

// Every epilogue of the gate/up form GU and the down form RW.
#define MOK_FP8_FORWARD_KERNELS(GU, RW)                                                            \
  template void launch_grouped_gemm<GU, SwigluForward<false>>(const GemmDescriptor&, Stream,       \
                                                              Scales);                             \
  template void launch_grouped_gemm<GU, SwigluForward<true>>(const GemmDescriptor&, Stream,        \
                                                             Scales);                              \
  template void launch_grouped_gemm<GU, SwigluForward<false, true>>(const GemmDescriptor&, Stream, \
                                                                    Scales);                       \
  template void launch_grouped_gemm<GU, SwigluForward<true, true>>(const GemmDescriptor&, Stream,  \
                                                                   Scales);                        \
  template void launch_grouped_gemm<RW, RowsBf16<false, false>>(const GemmDescriptor&, Stream,     \
                                                                Scales);                           \
  template void launch_grouped_gemm<RW, RowsBf16<false, true>>(const GemmDescriptor&, Stream,      \
                                                               Scales);                            \
  template void launch_grouped_gemm<RW, RowsBf16<true, false>>(const GemmDescriptor&, Stream,      \
                                                               Scales);                            \
  template void launch_grouped_gemm<RW, RowsBf16<true, true>>(const GemmDescriptor&, Stream,       \
                                                              Scales);

template <bool kPair, bool kOverlap, bool kWide = false>
using GateUp = Form<FormKind::kGateUp, Operand::e4m3, kPair, kOverlap, false, kWide>;
template <bool kPair, bool kOverlap, bool kWide = false>
using Down = Form<FormKind::kRowsWT, Operand::e4m3, kPair, kOverlap, false, kWide>;
using GateUpPlain = GateUp<false, false>;
using DownPlain = Down<false, false>;
using GateUpPairs = GateUp<true, false>;  // clusters of two CTAs sharing weight tiles
using DownPairs = Down<true, false>;
using GateUpOverlap = GateUp<false, true>;  // a K block's wgmma in flight during a promotion
using DownOverlap = Down<false, true>;
using GateUpPairsOverlap = GateUp<true, true>;
using DownPairsOverlap = Down<true, true>;
using GateUpWide = GateUp<false, false, true>;  // 128 x 256 tiles
using DownWide = Down<false, false, true>;
MOK_FP8_FORWARD_KERNELS(GateUpPlain, DownPlain)
MOK_FP8_FORWARD_KERNELS(GateUpPairs, DownPairs)
MOK_FP8_FORWARD_KERNELS(GateUpOverlap, DownOverlap)
MOK_FP8_FORWARD_KERNELS(GateUpPairsOverlap, DownPairsOverlap)
MOK_FP8_FORWARD_KERNELS(GateUpWide, DownWide)
#undef MOK_FP8_FORWARD_KERNELS
// GateUpForwardFp8Args::hidden_quantized: the SwiGLU that also quantizes hidden, on wide tiles.
template void launch_grouped_gemm<GateUpWide, SwigluForward<false, false, true>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<GateUpWide, SwigluForward<true, false, true>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<GateUpWide, SwigluForward<false, true, true>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<GateUpWide, SwigluForward<true, true, true>>(
    const GemmDescriptor&, Stream, Scales);

}  // namespace mok::gemm
