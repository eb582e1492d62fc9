// Expert parallelism as a team across processes, run as host threads on one GPU (the CUDA layer
// tests of the bf16 and the FP8 layer; mok_layer_tests only). test_layer_gpu.cpp says why this
// binary asks for 32 hardware queues and eager module loading, and why a stall passes only when
// proven the driver's queue.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

// Gives a repetition's ranks what the layer needs beyond split_into_ranks (the FP8 layer: each
// rank's quantized weights, RankTensors::q), from that repetition's device layer; what it returns
// is kept alive until the repetition's checks are done.
using PrepareRanks =
    std::function<std::shared_ptr<void>(cuda::DeviceLayer&, std::vector<cuda::RankTensors>&)>;

// The W = p.ep_size ranks of rank problem `p` as a team across processes (cuda::ExternalRank over
// W symmetric regions), each rank a cuda::Layer (`fp8`: with the FP8 scratch) driven by its own
// host thread and stream: `repetitions` training steps on fresh, poisoned outputs from `many`'s
// inputs, every output and gradient compared bitwise with `one` (the whole layer on one GPU).
inline void run_external_team(const Problem& p, const LayerData& one, LayerData many,
                              const std::string& what, int repetitions, std::uint64_t timeout_ms,
                              bool fp8 = false, const PrepareRanks& prepare = {}) {
  const int W = p.ep_size;
  int stalls = 0, queue_stalls = 0;
  // The team lives for the whole case, as a training job's layers do: its regions, its
  // layers (with their weight-gradient side streams) and the ranks' streams are made once,
  // streams first, so the driver deals the case's streams their hardware queues once.
  std::vector<cudaStream_t> streams(W);
  for (cudaStream_t& s : streams) {
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  }
  const std::int64_t bytes = symmetric_workspace_bytes(p, Config{});
  std::vector<std::unique_ptr<DeviceBuffer<std::uint8_t>>> regions;
  std::vector<void*> bases;
  for (int r = 0; r < W; ++r) {
    regions.push_back(
        std::make_unique<DeviceBuffer<std::uint8_t>>(static_cast<std::size_t>(bytes)));
    bases.push_back(regions.back()->get());
  }
  std::vector<std::unique_ptr<cuda::Layer>> layers;
  for (int r = 0; r < W; ++r) {
    Problem mine = p;
    mine.ep_rank = r;
    layers.push_back(std::make_unique<cuda::Layer>(mine, Config{}, 0,
                                                   cuda::ExternalRank{bases, timeout_ms}, fp8));
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // every rank's team exists
  for (int repetition = 1; repetition <= repetitions; ++repetition) {
    cuda::DeviceLayer g(many);  // fresh, poisoned outputs
    std::vector<std::unique_ptr<cuda::DeviceTensor>> scratch;
    std::vector<std::unique_ptr<cuda::DeviceContext>> contexts;
    std::vector<cuda::RankTensors> ranks = split_into_ranks(g, p, scratch, contexts);
    const std::shared_ptr<void> held = prepare ? prepare(g, ranks) : nullptr;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<std::string> failures(W);
    // Host time of each rank's forward and backward calls (launches only): a stall whose
    // straggler's calls took about the timeout was its host thread held up (a driver lock, a
    // module load); one whose calls returned at once was the GPU not running its kernels.
    std::vector<double> launch_ms(W, 0.0);
    // When each rank's stream reached the GPU (its first command, an event with timing).
    std::vector<cudaEvent_t> reached(W);
    for (cudaEvent_t& e : reached) ASSERT_EQ(cudaEventCreate(&e), cudaSuccess);
    std::vector<std::thread> threads;
    for (int r = 0; r < W; ++r) {
      threads.emplace_back([&, r] {
        try {
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
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    // Each rank's start, in ms after the earliest rank's.
    std::vector<float> start_ms(W, 0.0f);
    for (int r = 0; r < W; ++r) {
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
      g.download(many);
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
    bool proven = only_stalls;
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
}

}  // namespace mok::test
