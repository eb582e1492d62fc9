// The library's e4m3 input-gradient instantiations of the standalone grouped GEMM kernel
// (sm90_bf16_grouped_gemm.cuh over Form<kRowsWT, Operand::e4m3> reading the weights' transposed
// copies): every epilogue rows_times_weight_fp8 picks (src/cuda/gemm/launch.cu,
// launch_input_gradient). A file of its own so that it compiles beside the forward's.
#include "cuda/kernels/sm90_bf16_grouped_gemm.cuh"

namespace mok::gemm {

using epilogue::RowsBf16;
using epilogue::RowsFp32;
using epilogue::SwigluBackward;
using Stream = cudaStream_t;
using Scales = const Fp8Scales&;
using RowsWT = Form<FormKind::kRowsWT, Operand::e4m3>;
using RowsWTPairs = Form<FormKind::kRowsWT, Operand::e4m3, true>;  // RowsTimesWeightFp8Args::pairs
// RowsBf16<false, *> of this form are instantiated by sm90_fp8_grouped_gemm.cu (the down forward).
template void launch_grouped_gemm<RowsWT, RowsFp32>(const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<false, false>>(const GemmDescriptor&,
                                                                        Stream, Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<false, true>>(const GemmDescriptor&,
                                                                       Stream, Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<true, false>>(const GemmDescriptor&,
                                                                       Stream, Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<true, true>>(const GemmDescriptor&, Stream,
                                                                      Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<false, false, true>>(const GemmDescriptor&,
                                                                              Stream, Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<false, true, true>>(const GemmDescriptor&,
                                                                             Stream, Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<true, false, true>>(const GemmDescriptor&,
                                                                             Stream, Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<true, true, true>>(const GemmDescriptor&,
                                                                            Stream, Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<true, true, false, true>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<RowsWT, SwigluBackward<true, true, true, true>>(
    const GemmDescriptor&, Stream, Scales);

// The same in pairs (RowsBf16<false, *>: sm90_fp8_grouped_gemm.cu).
template void launch_grouped_gemm<RowsWTPairs, RowsFp32>(const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<false, false>>(const GemmDescriptor&,
                                                                             Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<false, true>>(const GemmDescriptor&,
                                                                            Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<true, false>>(const GemmDescriptor&,
                                                                            Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<true, true>>(const GemmDescriptor&,
                                                                           Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<false, false, true>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<false, true, true>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<true, false, true>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<true, true, true>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<true, true, false, true>>(
    const GemmDescriptor&, Stream, Scales);
template void launch_grouped_gemm<RowsWTPairs, SwigluBackward<true, true, true, true>>(
    const GemmDescriptor&, Stream, Scales);

}  // namespace mok::gemm
