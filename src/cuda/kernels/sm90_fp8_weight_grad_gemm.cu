// The library's e4m3 weight-gradient instantiations of the standalone grouped GEMM kernel
// (sm90_grouped_gemm.cuh over the K-grouped forms with Operand::e4m3, reading the token-axis
// copies): every output weight_grad_fp8 picks (src/cuda/gemm/launch.cu, launch_weight_grad), with
// and without the overlapped promotion, and the plain form with and without the staged store.
#include "cuda/kernels/sm90_grouped_gemm.cuh"

namespace mok::gemm {

using epilogue::GradOut;
using epilogue::WeightGrad;
using Stream = cudaStream_t;
using Scales = const Fp8Params&;
// Every output for form F.
#define MOK_FP8_WEIGHT_GRAD_KERNELS(F)                                                           \
  template void launch_grouped_gemm<F, WeightGrad<GradOut::bf16>>(const GemmDescriptor&, Stream, \
                                                                  Scales);                       \
  template void launch_grouped_gemm<F, WeightGrad<GradOut::fp32>>(const GemmDescriptor&, Stream, \
                                                                  Scales);                       \
  template void launch_grouped_gemm<F, WeightGrad<GradOut::fp32_add>>(const GemmDescriptor&,     \
                                                                      Stream, Scales);

using Plain = Form<FormKind::kWeightGrad, Operand::e4m3>;
using Continued = Form<FormKind::kWeightGradContinued, Operand::e4m3>;
// WeightGradFp8Args::overlap: the next token block's wgmma in flight during a promotion.
using PlainOverlap = Form<FormKind::kWeightGrad, Operand::e4m3, false, true>;
using ContinuedOverlap = Form<FormKind::kWeightGradContinued, Operand::e4m3, false, true>;
// WeightGradFp8Args::tma_store: bf16 output tiles through shared memory and TMA (plain form only:
// a continued reduction's outputs are fp32).
using PlainStaged = Form<FormKind::kWeightGrad, Operand::e4m3, false, false, true>;
using PlainOverlapStaged = Form<FormKind::kWeightGrad, Operand::e4m3, false, true, true>;
MOK_FP8_WEIGHT_GRAD_KERNELS(Plain)
MOK_FP8_WEIGHT_GRAD_KERNELS(Continued)
MOK_FP8_WEIGHT_GRAD_KERNELS(PlainOverlap)
MOK_FP8_WEIGHT_GRAD_KERNELS(ContinuedOverlap)
MOK_FP8_WEIGHT_GRAD_KERNELS(PlainStaged)
MOK_FP8_WEIGHT_GRAD_KERNELS(PlainOverlapStaged)
#undef MOK_FP8_WEIGHT_GRAD_KERNELS

}  // namespace mok::gemm
