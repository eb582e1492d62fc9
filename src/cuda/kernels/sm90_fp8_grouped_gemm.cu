// The library's e4m3 instantiations of the standalone grouped GEMM kernel
// (sm90_bf16_grouped_gemm.cuh, the same kernel over Form<kind, Operand::e4m3>): the (form,
// epilogue) pairs gate_up_forward_fp8 and rows_times_weight_t_fp8 pick (src/cuda/gemm/launch.cu),
// for each mainloop (the launchers' `pairs` and `overlap`).
#include "cuda/kernels/sm90_bf16_grouped_gemm.cuh"

namespace mok::gemm {

using epilogue::RowsBf16;
using epilogue::SwigluForward;
using Stream = cudaStream_t;
using Scales = const Fp8Scales&;

#define MOK_FP8_FORWARD_KERNELS(kPair, kOverlap)                                                   \
  template void launch_grouped_gemm<Form<FormKind::kGateUp, Operand::e4m3, kPair, kOverlap>,       \
                                    SwigluForward<false>>(const GemmDescriptor&, Stream, Scales);  \
  template void launch_grouped_gemm<Form<FormKind::kGateUp, Operand::e4m3, kPair, kOverlap>,       \
                                    SwigluForward<true>>(const GemmDescriptor&, Stream, Scales);   \
  template void launch_grouped_gemm<Form<FormKind::kGateUp, Operand::e4m3, kPair, kOverlap>,       \
                                    SwigluForward<false, true>>(const GemmDescriptor&, Stream,     \
                                                                Scales);                           \
  template void launch_grouped_gemm<Form<FormKind::kGateUp, Operand::e4m3, kPair, kOverlap>,       \
                                    SwigluForward<true, true>>(const GemmDescriptor&, Stream,      \
                                                               Scales);                            \
  template void launch_grouped_gemm<Form<FormKind::kRowsWT, Operand::e4m3, kPair, kOverlap>,       \
                                    RowsBf16<false, false>>(const GemmDescriptor&, Stream,         \
                                                            Scales);                               \
  template void launch_grouped_gemm<Form<FormKind::kRowsWT, Operand::e4m3, kPair, kOverlap>,       \
                                    RowsBf16<false, true>>(const GemmDescriptor&, Stream, Scales); \
  template void launch_grouped_gemm<Form<FormKind::kRowsWT, Operand::e4m3, kPair, kOverlap>,       \
                                    RowsBf16<true, false>>(const GemmDescriptor&, Stream, Scales); \
  template void launch_grouped_gemm<Form<FormKind::kRowsWT, Operand::e4m3, kPair, kOverlap>,       \
                                    RowsBf16<true, true>>(const GemmDescriptor&, Stream, Scales);

MOK_FP8_FORWARD_KERNELS(false, false)
MOK_FP8_FORWARD_KERNELS(true, false)  // pairs: clusters of two CTAs sharing weight tiles
MOK_FP8_FORWARD_KERNELS(false, true)  // overlap: a K block's wgmma in flight during a promotion
MOK_FP8_FORWARD_KERNELS(true, true)
#undef MOK_FP8_FORWARD_KERNELS

}  // namespace mok::gemm
