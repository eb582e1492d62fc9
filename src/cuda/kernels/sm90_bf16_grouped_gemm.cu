// The library's bf16 instantiations of the standalone grouped GEMM kernel
// (sm90_grouped_gemm.cuh): every (form, epilogue) pair the launchers pick
// (src/cuda/gemm/launch.cu), without test hooks. The e4m3 forms' are in sm90_fp8_grouped_gemm.cu,
// sm90_fp8_input_grad_gemm.cu and sm90_fp8_weight_grad_gemm.cu.
#include "cuda/kernels/sm90_grouped_gemm.cuh"

namespace mok::gemm {

using epilogue::GradOut;
using epilogue::RowsBf16;
using epilogue::RowsFp32;
using epilogue::SwigluBackward;
using epilogue::SwigluForward;
using epilogue::WeightGrad;
using Stream = cudaStream_t;
using GateUp = Form<FormKind::kGateUp>;
using RowsWT = Form<FormKind::kRowsWT>;
using RowsW = Form<FormKind::kRowsW>;
using WeightGradForm = Form<FormKind::kWeightGrad>;
using WeightGradContinued = Form<FormKind::kWeightGradContinued>;
template void launch_grouped_gemm<GateUp, SwigluForward<false>>(const GemmDescriptor&, Stream,
                                                                const Fp8Params&);
template void launch_grouped_gemm<GateUp, SwigluForward<true>>(const GemmDescriptor&, Stream,
                                                               const Fp8Params&);
// Clamped SwiGLU (swiglu_limit): the same epilogues with kClamped (run on the H200 at 7db507e).
template void launch_grouped_gemm<GateUp, SwigluForward<false, true>>(const GemmDescriptor&, Stream,
                                                                      const Fp8Params&);
template void launch_grouped_gemm<GateUp, SwigluForward<true, true>>(const GemmDescriptor&, Stream,
                                                                     const Fp8Params&);
template void launch_grouped_gemm<RowsWT, RowsBf16<false, false>>(const GemmDescriptor&, Stream,
                                                                  const Fp8Params&);
template void launch_grouped_gemm<RowsWT, RowsBf16<false, true>>(const GemmDescriptor&, Stream,
                                                                 const Fp8Params&);
template void launch_grouped_gemm<RowsWT, RowsBf16<true, false>>(const GemmDescriptor&, Stream,
                                                                 const Fp8Params&);
template void launch_grouped_gemm<RowsWT, RowsBf16<true, true>>(const GemmDescriptor&, Stream,
                                                                const Fp8Params&);
template void launch_grouped_gemm<RowsW, RowsBf16<false, false>>(const GemmDescriptor&, Stream,
                                                                 const Fp8Params&);
template void launch_grouped_gemm<RowsW, RowsBf16<false, true>>(const GemmDescriptor&, Stream,
                                                                const Fp8Params&);
template void launch_grouped_gemm<RowsW, RowsFp32>(const GemmDescriptor&, Stream, const Fp8Params&);
template void launch_grouped_gemm<RowsW, SwigluBackward<false, false>>(const GemmDescriptor&,
                                                                       Stream, const Fp8Params&);
template void launch_grouped_gemm<RowsW, SwigluBackward<false, true>>(const GemmDescriptor&, Stream,
                                                                      const Fp8Params&);
template void launch_grouped_gemm<RowsW, SwigluBackward<true, false>>(const GemmDescriptor&, Stream,
                                                                      const Fp8Params&);
template void launch_grouped_gemm<RowsW, SwigluBackward<true, true>>(const GemmDescriptor&, Stream,
                                                                     const Fp8Params&);
template void launch_grouped_gemm<RowsW, SwigluBackward<false, false, true>>(const GemmDescriptor&,
                                                                             Stream,
                                                                             const Fp8Params&);
template void launch_grouped_gemm<RowsW, SwigluBackward<false, true, true>>(const GemmDescriptor&,
                                                                            Stream,
                                                                            const Fp8Params&);
template void launch_grouped_gemm<RowsW, SwigluBackward<true, false, true>>(const GemmDescriptor&,
                                                                            Stream,
                                                                            const Fp8Params&);
template void launch_grouped_gemm<RowsW, SwigluBackward<true, true, true>>(const GemmDescriptor&,
                                                                           Stream,
                                                                           const Fp8Params&);
// The routed backward where I <= H: bf16(w h) for the down weight gradient as well (b1528ab).
template void launch_grouped_gemm<RowsW, SwigluBackward<true, true, false, true>>(
    const GemmDescriptor&, Stream, const Fp8Params&);
template void launch_grouped_gemm<RowsW, SwigluBackward<true, true, true, true>>(
    const GemmDescriptor&, Stream, const Fp8Params&);
template void launch_grouped_gemm<WeightGradForm, WeightGrad<GradOut::bf16>>(const GemmDescriptor&,
                                                                             Stream,
                                                                             const Fp8Params&);
template void launch_grouped_gemm<WeightGradForm, WeightGrad<GradOut::fp32>>(const GemmDescriptor&,
                                                                             Stream,
                                                                             const Fp8Params&);
template void launch_grouped_gemm<WeightGradForm, WeightGrad<GradOut::fp32_add>>(
    const GemmDescriptor&, Stream, const Fp8Params&);
template void launch_grouped_gemm<WeightGradContinued, WeightGrad<GradOut::bf16>>(
    const GemmDescriptor&, Stream, const Fp8Params&);
template void launch_grouped_gemm<WeightGradContinued, WeightGrad<GradOut::fp32>>(
    const GemmDescriptor&, Stream, const Fp8Params&);
template void launch_grouped_gemm<WeightGradContinued, WeightGrad<GradOut::fp32_add>>(
    const GemmDescriptor&, Stream, const Fp8Params&);

}  // namespace mok::gemm
