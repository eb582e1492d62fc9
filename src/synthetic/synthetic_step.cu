// The CLI's GPU step: synthetic host data through the CUDA backend, timed with CUDA events.
#include <algorithm>
#include <vector>

#include "core/workspace.hpp"
#include "cuda/comm/team.hpp"  // cuda_check
#include "synthetic/device_layer.hpp"
#include "synthetic/synthetic_step.hpp"

namespace mok::cuda {

StepTimes run_synthetic_step(LayerData& data, const Config& config, int device, int warmup,
                             int reps) {
  if (reps < 1) throw Error("reps", "at least 1", to_text(reps));
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  DeviceLayer g(data);
  Workspace ws(data.problem, config, {.backend = Backend::cuda, .device_index = device});
  DeviceContext ctx(ws);
  cudaEvent_t marks[3];
  for (auto& e : marks) cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  std::vector<float> fwd, bwd;
  for (int i = 0; i < warmup + reps; ++i) {
    g.poison();
    cuda_check(cudaEventRecord(marks[0]), "cudaEventRecord");
    forward(ws, g.inputs(), g.weights(), g.out.view(), ctx.get());
    cuda_check(cudaEventRecord(marks[1]), "cudaEventRecord");
    backward(ws, g.inputs(), g.weights(), ctx.get(), g.d_out.view(), g.grads());
    cuda_check(cudaEventRecord(marks[2]), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(marks[2]), "the layer step");
    if (i < warmup) continue;
    float f = 0, b = 0;
    cudaEventElapsedTime(&f, marks[0], marks[1]);
    cudaEventElapsedTime(&b, marks[1], marks[2]);
    fwd.push_back(f);
    bwd.push_back(b);
  }
  for (auto& e : marks) cudaEventDestroy(e);
  // Device-side errors of the steps (bad ids, timeouts) before their outputs are trusted.
  ws.impl().layer->check_errors(nullptr);
  g.download(data);
  std::sort(fwd.begin(), fwd.end());
  std::sort(bwd.begin(), bwd.end());
  return {fwd[fwd.size() / 2], bwd[bwd.size() / 2]};
}

}  // namespace mok::cuda
