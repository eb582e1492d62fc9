// The library's instantiations of the standalone grouped GEMM kernel (sm90_bf16_grouped_gemm.cuh):
// every (form, epilogue) pair the launchers pick (src/cuda/gemm/launch.cu), without test hooks.
#include "cuda/kernels/sm90_bf16_grouped_gemm.cuh"

namespace mok::gemm {

template <FormKind kKind, class E>
void launch_grouped_gemm(const GemmDescriptor& d, cudaStream_t stream) {
  launch_grouped_gemm_kernel<Form<kKind>, E>(d, stream);
}

using epilogue::GradOut;
using epilogue::RowsBf16;
using epilogue::RowsFp32;
using epilogue::SwigluBackward;
using epilogue::SwigluForward;
using epilogue::WeightGrad;
using Stream = cudaStream_t;
template void launch_grouped_gemm<FormKind::kGateUp, SwigluForward<false>>(const GemmDescriptor&,
                                                                           Stream);
template void launch_grouped_gemm<FormKind::kGateUp, SwigluForward<true>>(const GemmDescriptor&,
                                                                          Stream);
// Clamped SwiGLU (swiglu_limit): the same epilogues with kClamped (run on the H200 at 7db507e).
template void launch_grouped_gemm<FormKind::kGateUp, SwigluForward<false, true>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kGateUp, SwigluForward<true, true>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsWT, RowsBf16<false, false>>(const GemmDescriptor&,
                                                                             Stream);
template void launch_grouped_gemm<FormKind::kRowsWT, RowsBf16<false, true>>(const GemmDescriptor&,
                                                                            Stream);
template void launch_grouped_gemm<FormKind::kRowsWT, RowsBf16<true, false>>(const GemmDescriptor&,
                                                                            Stream);
template void launch_grouped_gemm<FormKind::kRowsWT, RowsBf16<true, true>>(const GemmDescriptor&,
                                                                           Stream);
template void launch_grouped_gemm<FormKind::kRowsW, RowsBf16<false, false>>(const GemmDescriptor&,
                                                                            Stream);
template void launch_grouped_gemm<FormKind::kRowsW, RowsBf16<false, true>>(const GemmDescriptor&,
                                                                           Stream);
template void launch_grouped_gemm<FormKind::kRowsW, RowsFp32>(const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<false, false>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<false, true>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<true, false>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<true, true>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<false, false, true>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<false, true, true>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<true, false, true>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<true, true, true>>(
    const GemmDescriptor&, Stream);
// The routed backward where I <= H: bf16(w h) for the down weight gradient as well (b1528ab).
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<true, true, false, true>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kRowsW, SwigluBackward<true, true, true, true>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kWeightGrad, WeightGrad<GradOut::bf16>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kWeightGrad, WeightGrad<GradOut::fp32>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kWeightGrad, WeightGrad<GradOut::fp32_add>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kWeightGradContinued, WeightGrad<GradOut::bf16>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kWeightGradContinued, WeightGrad<GradOut::fp32>>(
    const GemmDescriptor&, Stream);
template void launch_grouped_gemm<FormKind::kWeightGradContinued, WeightGrad<GradOut::fp32_add>>(
    const GemmDescriptor&, Stream);

}  // namespace mok::gemm
