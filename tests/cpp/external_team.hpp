// Expert parallelism as a team across processes, run as host threads on one GPU or spread over
// several (the CUDA layer tests of the bf16 and the FP8 layer; mok_layer_tests only).
// test_layer_gpu.cpp says why this binary asks for 32 hardware queues and eager module loading,
// and why a stall on one GPU passes only when proven the driver's queue.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cuda/layer/layer.hpp"
#include "gpu_buffer.hpp"
#include "layer_gpu_helpers.hpp"
#include "layer_helpers.hpp"
#include "mok/schedule.hpp"
#include "synthetic/device_layer.hpp"

namespace mok::test {

// The routed results of the ranks (`many`) against one GPU running the whole layer (`one`).
inline void expect_single_gpu_bits(const LayerData& one, const LayerData& many,
                                   const std::string& what) {
  EXPECT_TRUE(same_bits(one.out, many.out)) << what << ": out";
  EXPECT_TRUE(same_bits(one.d_x, many.d_x)) << what << ": d_x";
  EXPECT_TRUE(same_bits(one.d_topk_weights, many.d_topk_weights)) << what << ": d_w";
  EXPECT_TRUE(same_bits(one.d_gate, many.d_gate)) << what << ": d_gate";
  EXPECT_TRUE(same_bits(one.d_up, many.d_up)) << what << ": d_up";
  EXPECT_TRUE(same_bits(one.d_down, many.d_down)) << what << ": d_down";
}

// Each rank's routed results from its GPU's copy of the layer (`copies[r % devices]`) into
// `many`: its tokens' out, d_x and d_topk_weights, its experts' weight gradients.
inline void download_ranks(const std::vector<std::unique_ptr<cuda::DeviceLayer>>& copies,
                           const Problem& p, int devices, LayerData& many) {
  if (devices == 1) {
    copies[0]->download(many);
    return;
  }
  const std::int64_t T = p.num_tokens, E_l = p.num_local_experts();
  for (int d = 0; d < devices; ++d) {
    LayerData all = many;
    copies[d]->download(all);
    for (int r = d; r < p.ep_size; r += devices) {
      auto take = [&](HostTensor& to, const HostTensor& from, std::int64_t first,
                      std::int64_t count) {
        const TensorView& v = from.view();
        const std::int64_t row = v.numel() / v.shape[0] * dtype_size(v.dtype);
        std::memcpy(static_cast<char*>(to.view().data) + first * row,
                    static_cast<const char*>(v.data) + first * row,
                    static_cast<std::size_t>(count * row));
      };
      take(many.out, all.out, r * T, T);
      take(many.d_x, all.d_x, r * T, T);
      take(many.d_topk_weights, all.d_topk_weights, r * T, T);
      take(many.d_gate, all.d_gate, r * E_l, E_l);
      take(many.d_up, all.d_up, r * E_l, E_l);
      take(many.d_down, all.d_down, r * E_l, E_l);
    }
  }
}

// The team sizes of a test with one rank per GPU: 2 and every GPU the machine has, up to 8; none
// where it has fewer than two, with `why` saying so for the test's skip (scripts/gpu-suite
// expects the words "GPUs (one per rank)").
inline std::vector<int> several_gpu_teams(std::string& why) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (count < 2) {
    why = std::to_string(count) +
          " CUDA GPU(s) here: the team on several GPUs needs 2 GPUs (one per rank)";
    return {};
  }
  const int most = std::min(count, 8);
  return most > 2 ? std::vector<int>{2, most} : std::vector<int>{2};
}

// Gives a repetition's ranks what the layer needs beyond split_into_ranks (the FP8 layer: each
// rank's quantized weights, RankTensors::q), from a device's copy of that repetition's layer, with
// that device current (on several GPUs it is called once per GPU, for the ranks there); what it
// returns is kept alive until the repetition's checks are done.
using PrepareRanks =
    std::function<std::shared_ptr<void>(cuda::DeviceLayer&, std::vector<cuda::RankTensors>&)>;

// The W = p.ep_size ranks of rank problem `p` as a team across processes (cuda::ExternalRank over
// W symmetric regions), each rank a cuda::Layer (`fp8`: with the FP8 scratch) driven by its own
// host thread and stream: `repetitions` training steps on fresh, poisoned outputs from `many`'s
// inputs, every output and gradient compared bitwise with `one` (the whole layer on one GPU).
// `devices` > 1: rank r on GPU r % devices, with its region, stream and a copy of the layer's
// tensors there, the peers' regions reached through peer access (as a process reaches them
// through PyTorch's symmetric memory); `fused`: the forward megakernel (ForwardHooks::
// untested_team), on one GPU or several.
inline void run_external_team(const Problem& p, const LayerData& one, LayerData many,
                              const std::string& what, int repetitions, std::uint64_t timeout_ms,
                              bool fp8 = false, const PrepareRanks& prepare = {}, int devices = 1,
                              bool fused = false) {
  const int W = p.ep_size;
  // A megakernel holds every SM of its GPU until its peers' rows come: one rank per GPU.
  ASSERT_TRUE(!fused || devices == W) << "the fused forward needs one GPU per rank";
  auto device_of = [&](int r) { return r % devices; };
  auto sync_all = [&] {
    for (int d = 0; d < devices; ++d) {
      if (cudaSetDevice(d) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return false;
    }
    return cudaSetDevice(0) == cudaSuccess;
  };
  for (int d = 0; d < devices; ++d) {  // every GPU reaches every other's memory
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    for (int peer = 0; peer < devices; ++peer) {
      if (peer == d) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
      ASSERT_TRUE(e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled)
          << "peer access from GPU " << d << " to GPU " << peer << ": " << cudaGetErrorString(e);
      cudaGetLastError();  // clear cudaErrorPeerAccessAlreadyEnabled
    }
  }
  int stalls = 0, queue_stalls = 0;
  // The team lives for the whole case, as a training job's layers do: its regions, its
  // layers (with their weight-gradient side streams) and the ranks' streams are made once,
  // streams first, so the driver deals the case's streams their hardware queues once.
  std::vector<cudaStream_t> streams(W);
  for (int r = 0; r < W; ++r) {
    ASSERT_EQ(cudaSetDevice(device_of(r)), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking), cudaSuccess);
  }
  const std::int64_t bytes = symmetric_workspace_bytes(p, Config{});
  std::vector<std::unique_ptr<DeviceBuffer<std::uint8_t>>> regions;
  std::vector<void*> bases;
  for (int r = 0; r < W; ++r) {
    ASSERT_EQ(cudaSetDevice(device_of(r)), cudaSuccess);
    regions.push_back(
        std::make_unique<DeviceBuffer<std::uint8_t>>(static_cast<std::size_t>(bytes)));
    bases.push_back(regions.back()->get());
  }
  std::vector<std::unique_ptr<cuda::Layer>> layers;
  for (int r = 0; r < W; ++r) {
    Problem mine = p;
    mine.ep_rank = r;
    layers.push_back(std::make_unique<cuda::Layer>(mine, Config{}, device_of(r),
                                                   cuda::ExternalRank{bases, timeout_ms}, fp8));
    if (fused) {
      layers.back()->set_forward_hooks({.untested_team = true});
      layers.back()->set_forward_path(ForwardPath::fused);
    }
  }
  ASSERT_TRUE(sync_all());  // every rank's team exists
  for (int repetition = 1; repetition <= repetitions; ++repetition) {
    // Fresh, poisoned outputs: the whole layer's tensors on each GPU, each rank's views into
    // its own GPU's copy.
    std::vector<std::unique_ptr<cuda::DeviceLayer>> copies;
    std::vector<std::unique_ptr<cuda::DeviceTensor>> scratch;
    std::vector<std::unique_ptr<cuda::DeviceContext>> contexts;
    std::vector<cuda::RankTensors> ranks(W);
    std::vector<std::shared_ptr<void>> held;  // what `prepare` made, per GPU
    for (int d = 0; d < devices; ++d) {
      ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
      copies.push_back(std::make_unique<cuda::DeviceLayer>(many));
      std::vector<cuda::RankTensors> all = split_into_ranks(*copies[d], p, scratch, contexts);
      if (prepare) held.push_back(prepare(*copies[d], all));
      for (int r = d; r < W; r += devices) ranks[r] = all[r];
    }
    ASSERT_TRUE(sync_all());
    std::vector<std::string> failures(W);
    // Host time of each rank's forward and backward calls (launches only): a stall whose
    // straggler's calls took about the timeout was its host thread held up (a driver lock, a
    // module load); one whose calls returned at once was the GPU not running its kernels.
    std::vector<double> launch_ms(W, 0.0);
    // When each rank's stream reached the GPU (its first command, an event with timing).
    std::vector<cudaEvent_t> reached(W);
    for (int r = 0; r < W; ++r) {
      ASSERT_EQ(cudaSetDevice(device_of(r)), cudaSuccess);
      ASSERT_EQ(cudaEventCreate(&reached[r]), cudaSuccess);
    }
    std::vector<std::thread> threads;
    for (int r = 0; r < W; ++r) {
      threads.emplace_back([&, r] {
        try {
          if (cudaSetDevice(device_of(r)) != cudaSuccess) failures[r] = "cudaSetDevice";
          const std::span<const cuda::RankTensors> mine(&ranks[r], 1);
          const auto start = std::chrono::steady_clock::now();
          if (cudaEventRecord(reached[r], streams[r]) != cudaSuccess) failures[r] = "record";
          layers[r]->forward(mine, true, streams[r]);
          layers[r]->backward(mine, BackwardOptions{}, streams[r]);
          launch_ms[r] =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                  .count();
          if (cudaStreamSynchronize(streams[r]) != cudaSuccess) failures[r] = "sync";
          layers[r]->check_errors(streams[r]);
        } catch (const std::exception& e) {
          failures[r] = e.what();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    ASSERT_TRUE(sync_all()) << what;
    // Each rank's start, in ms after the earliest rank's (one GPU: events of several cannot be
    // compared, and the shared hardware queue below is one GPU's).
    std::vector<float> start_ms(W, 0.0f);
    for (int r = 0; r < W && devices == 1; ++r) {
      ASSERT_EQ(cudaEventElapsedTime(&start_ms[r], reached[0], reached[r]), cudaSuccess);
    }
    const float earliest = *std::min_element(start_ms.begin(), start_ms.end());
    for (float& v : start_ms) v -= earliest;
    for (cudaEvent_t e : reached) cudaEventDestroy(e);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << what;
    bool any = false, only_stalls = true;
    for (const std::string& f : failures) {
      if (f.empty()) continue;
      any = true;
      only_stalls = only_stalls && f.find("timed out") != std::string::npos &&
                    f.find("did not arrive") != std::string::npos;
    }
    if (!any) {
      download_ranks(copies, p, devices, many);
      expect_single_gpu_bits(one, many, what + ", repetition " + std::to_string(repetition));
      continue;
    }
    std::string all;
    for (int r = 0; r < W; ++r) {
      all += "\n  rank " + std::to_string(r) + " (calls returned after " +
             std::to_string(launch_ms[r]) + " ms, its stream reached the GPU " +
             std::to_string(start_ms[r]) + " ms after the first): " +
             (failures[r].empty() ? std::string("no error") : failures[r]);
    }
    // Proven the driver's queue: every rank that timed out waited for a rank whose stream
    // reached the GPU at least half the timeout late although its calls had returned at once.
    bool proven = only_stalls && devices == 1;
    for (int r = 0; r < W && proven; ++r) {
      if (failures[r].empty()) continue;
      const std::size_t at = failures[r].find("rank ", failures[r].find("did not arrive") - 8);
      const int late = at == std::string::npos ? -1 : std::atoi(failures[r].c_str() + at + 5);
      proven = late >= 0 && late < W && start_ms[late] >= 0.5f * timeout_ms &&
               launch_ms[late] < 0.25 * timeout_ms;
    }
    ++stalls;
    if (proven) {
      ++queue_stalls;
      std::printf(
          "[ mok ] %s, repetition %d of %d: a rank's stream reached the GPU late "
          "behind another stream's work in a shared hardware queue:%s\n",
          what.c_str(), repetition, repetitions, all.c_str());
      continue;
    }
    ADD_FAILURE() << what << ", repetition " << repetition << " of " << repetitions
                  << (only_stalls ? ": a rank never arrived, not proven the driver's queue"
                                  : ": an error")
                  << ":" << all;
  }
  std::printf("[ mok ] %s: %d of %d repetitions stalled, %d of them proven the driver's queue\n",
              what.c_str(), stalls, repetitions, queue_stalls);
  layers.clear();
  for (cudaStream_t s : streams) cudaStreamDestroy(s);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

}  // namespace mok::test
