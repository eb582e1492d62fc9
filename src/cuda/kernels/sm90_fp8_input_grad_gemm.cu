// The library's e4m3 input-gradient instantiations of the standalone grouped GEMM kernel
// (sm90_grouped_gemm.cuh over Form<kRowsWT, Operand::e4m3> reading the weights' transposed
// copies): every epilogue rows_times_weight_fp8 picks (src/cuda/gemm/launch.cu,
// launch_input_gradient), for each mainloop (RowsTimesWeightFp8Args::pairs, ::overlap, ::wide),
// and the SwiGLU backward that quantizes (::quantized). A file of its own so that it compiles
// beside the forward's.
#include "cuda/kernels/sm90_grouped_gemm.cuh"

namespace mok::gemm {

using epilogue::RowsFp32;
using epilogue::SwigluBackward;
using Stream = cudaStream_t;
using Scales = const Fp8Params&;

// Every input-gradient epilogue of form F but RowsBf16<false, *>, which sm90_fp8_grouped_gemm.cu
// instantiates (the down forward's).
#define MOK_INPUT_GRADIENT_KERNELS(F)                                                              \
  template void launch_grouped_gemm<F, RowsFp32>(const GemmDescriptor&, Stream, Scales);           \
  template void launch_grouped_gemm<F, SwigluBackward<false, false>>(const GemmDescriptor&,        \
                                                                     Stream, Scales);              \
  template void launch_grouped_gemm<F, SwigluBackward<false, true>>(const GemmDescriptor&, Stream, \
                                                                    Scales);                       \
  template void launch_grouped_gemm<F, SwigluBackward<true, false>>(const GemmDescriptor&, Stream, \
                                                                    Scales);                       \
  template void launch_grouped_gemm<F, SwigluBackward<true, true>>(const GemmDescriptor&, Stream,  \
                                                                   Scales);                        \
  template void launch_grouped_gemm<F, SwigluBackward<false, false, true>>(const GemmDescriptor&,  \
                                                                           Stream, Scales);        \
  template void launch_grouped_gemm<F, SwigluBackward<false, true, true>>(const GemmDescriptor&,   \
                                                                          Stream, Scales);         \
  template void launch_grouped_gemm<F, SwigluBackward<true, false, true>>(const GemmDescriptor&,   \
                                                                          Stream, Scales);         \
  template void launch_grouped_gemm<F, SwigluBackward<true, true, true>>(const GemmDescriptor&,    \
                                                                         Stream, Scales);          \
  template void launch_grouped_gemm<F, SwigluBackward<true, true, false, true>>(                   \
      const GemmDescriptor&, Stream, Scales);                                                      \
  template void launch_grouped_gemm<F, SwigluBackward<true, true, true, true>>(                    \
      const GemmDescriptor&, Stream, Scales);

using RowsWT = Form<FormKind::kRowsWT, Operand::e4m3>;
using RowsWTPairs = Form<FormKind::kRowsWT, Operand::e4m3, true>;
using RowsWTOverlap = Form<FormKind::kRowsWT, Operand::e4m3, false, true>;
using RowsWTPairsOverlap = Form<FormKind::kRowsWT, Operand::e4m3, true, true>;
MOK_INPUT_GRADIENT_KERNELS(RowsWT)
MOK_INPUT_GRADIENT_KERNELS(RowsWTPairs)
MOK_INPUT_GRADIENT_KERNELS(RowsWTOverlap)
MOK_INPUT_GRADIENT_KERNELS(RowsWTPairsOverlap)
using RowsWTWide = Form<FormKind::kRowsWT, Operand::e4m3, false, false, false, true>;
MOK_INPUT_GRADIENT_KERNELS(RowsWTWide)
#undef MOK_INPUT_GRADIENT_KERNELS
// RowsTimesWeightFp8Args::quantized: the SwiGLU backward with the row scale and dot that also
// quantizes dg and du, plain and clamped: both forms on the form with a staging tile; the rows
// forms alone (with and without bf16(w h)) on the plain and the wide tiles.
using RowsWTStaged = Form<FormKind::kRowsWT, Operand::e4m3, false, false, true>;
template void launch_grouped_gemm<
    RowsWTStaged, SwigluBackward<true, true, false, false, QuantizedDgDu::rows_and_tokens>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<
    RowsWTStaged, SwigluBackward<true, true, true, false, QuantizedDgDu::rows_and_tokens>>(
    const GemmDescriptor&, Stream, Scales);
#define MOK_QUANTIZED_ROWS_KERNELS(F)                                                    \
  template void                                                                          \
  launch_grouped_gemm<F, SwigluBackward<true, true, false, false, QuantizedDgDu::rows>>( \
      const GemmDescriptor&, Stream, Scales);                                            \
  template void                                                                          \
  launch_grouped_gemm<F, SwigluBackward<true, true, true, false, QuantizedDgDu::rows>>(  \
      const GemmDescriptor&, Stream, Scales);                                            \
  template void                                                                          \
  launch_grouped_gemm<F, SwigluBackward<true, true, false, true, QuantizedDgDu::rows>>(  \
      const GemmDescriptor&, Stream, Scales);                                            \
  template void                                                                          \
  launch_grouped_gemm<F, SwigluBackward<true, true, true, true, QuantizedDgDu::rows>>(   \
      const GemmDescriptor&, Stream, Scales);
MOK_QUANTIZED_ROWS_KERNELS(RowsWT)
MOK_QUANTIZED_ROWS_KERNELS(RowsWTWide)
#undef MOK_QUANTIZED_ROWS_KERNELS

}  // namespace mok::gemm
