// The library's e4m3 instantiations of the standalone grouped GEMM kernel
// (sm90_bf16_grouped_gemm.cuh, the same kernel over Form<kind, Operand::e4m3>): the (form,
// epilogue) pairs gate_up_forward_fp8 and rows_times_weight_t_fp8 pick (src/cuda/gemm/launch.cu).
#include "cuda/kernels/sm90_bf16_grouped_gemm.cuh"

namespace mok::gemm {

using epilogue::RowsBf16;
using epilogue::SwigluForward;
using Stream = cudaStream_t;
using GateUp = Form<FormKind::kGateUp, Operand::e4m3>;
using RowsWT = Form<FormKind::kRowsWT, Operand::e4m3>;
// Pairs (GateUpForwardFp8Args::pairs, RowsTimesWeightTFp8Args::pairs): clusters of two CTAs.
using GateUpPairs = Form<FormKind::kGateUp, Operand::e4m3, true>;
using RowsWTPairs = Form<FormKind::kRowsWT, Operand::e4m3, true>;
template void launch_grouped_gemm<GateUp, SwigluForward<false>>(const GemmDescriptor&, Stream,
                                                                const Fp8Scales&);
template void launch_grouped_gemm<GateUp, SwigluForward<true>>(const GemmDescriptor&, Stream,
                                                               const Fp8Scales&);
template void launch_grouped_gemm<GateUp, SwigluForward<false, true>>(const GemmDescriptor&, Stream,
                                                                      const Fp8Scales&);
template void launch_grouped_gemm<GateUp, SwigluForward<true, true>>(const GemmDescriptor&, Stream,
                                                                     const Fp8Scales&);
template void launch_grouped_gemm<RowsWT, RowsBf16<false, false>>(const GemmDescriptor&, Stream,
                                                                  const Fp8Scales&);
template void launch_grouped_gemm<RowsWT, RowsBf16<false, true>>(const GemmDescriptor&, Stream,
                                                                 const Fp8Scales&);
template void launch_grouped_gemm<RowsWT, RowsBf16<true, false>>(const GemmDescriptor&, Stream,
                                                                 const Fp8Scales&);
template void launch_grouped_gemm<RowsWT, RowsBf16<true, true>>(const GemmDescriptor&, Stream,
                                                                const Fp8Scales&);
template void launch_grouped_gemm<GateUpPairs, SwigluForward<false>>(const GemmDescriptor&, Stream,
                                                                     const Fp8Scales&);
template void launch_grouped_gemm<GateUpPairs, SwigluForward<true>>(const GemmDescriptor&, Stream,
                                                                    const Fp8Scales&);
template void launch_grouped_gemm<GateUpPairs, SwigluForward<false, true>>(const GemmDescriptor&,
                                                                           Stream,
                                                                           const Fp8Scales&);
template void launch_grouped_gemm<GateUpPairs, SwigluForward<true, true>>(const GemmDescriptor&,
                                                                          Stream, const Fp8Scales&);
template void launch_grouped_gemm<RowsWTPairs, RowsBf16<false, false>>(const GemmDescriptor&,
                                                                       Stream, const Fp8Scales&);
template void launch_grouped_gemm<RowsWTPairs, RowsBf16<false, true>>(const GemmDescriptor&, Stream,
                                                                      const Fp8Scales&);
template void launch_grouped_gemm<RowsWTPairs, RowsBf16<true, false>>(const GemmDescriptor&, Stream,
                                                                      const Fp8Scales&);
template void launch_grouped_gemm<RowsWTPairs, RowsBf16<true, true>>(const GemmDescriptor&, Stream,
                                                                     const Fp8Scales&);

}  // namespace mok::gemm
