// The library's e4m3 weight-gradient instantiations of the standalone grouped GEMM kernel
// (sm90_bf16_grouped_gemm.cuh over the K-grouped forms with Operand::e4m3, reading the token-axis
// copies): every output weight_grad_fp8 picks (src/cuda/gemm/launch.cu, launch_weight_grad).
#include "cuda/kernels/sm90_bf16_grouped_gemm.cuh"

namespace mok::gemm {

using epilogue::GradOut;
using epilogue::WeightGrad;
using Stream = cudaStream_t;
using Scales = const Fp8Scales&;
using Plain = Form<FormKind::kWeightGrad, Operand::e4m3>;
using Continued = Form<FormKind::kWeightGradContinued, Operand::e4m3>;
template void launch_grouped_gemm<Plain, WeightGrad<GradOut::bf16>>(const GemmDescriptor&, Stream,
                                                                    Scales);
template void launch_grouped_gemm<Plain, WeightGrad<GradOut::fp32>>(const GemmDescriptor&, Stream,
                                                                    Scales);
template void launch_grouped_gemm<Plain, WeightGrad<GradOut::fp32_add>>(const GemmDescriptor&,
                                                                        Stream, Scales);
template void launch_grouped_gemm<Continued, WeightGrad<GradOut::bf16>>(const GemmDescriptor&,
                                                                        Stream, Scales);
template void launch_grouped_gemm<Continued, WeightGrad<GradOut::fp32>>(const GemmDescriptor&,
                                                                        Stream, Scales);
template void launch_grouped_gemm<Continued, WeightGrad<GradOut::fp32_add>>(const GemmDescriptor&,
                                                                            Stream, Scales);

}  // namespace mok::gemm
