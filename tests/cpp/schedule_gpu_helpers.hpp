// Device-side helpers of the schedule and team tests (CUDA builds only).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cuda/comm/team.hpp"
#include "gpu_buffer.hpp"
#include "mok/schedule.hpp"
#include "schedule_test_helpers.hpp"

namespace mok::test {

// Skips (visibly) without a Hopper GPU.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override { MOK_REQUIRE_HOPPER(); }
};

// Device int64 [T, k] id tensors, one per rank, each with a guard zone before and after it that
// the kernel must never touch.
class DeviceIds {
 public:
  static constexpr std::size_t kGuard = 4096;
  static constexpr unsigned char kGuardByte = 0x5a;

  DeviceIds(int ranks, std::int64_t T, std::int64_t k) : T_(T), k_(k) {
    bytes_ = static_cast<std::size_t>(T * k) * sizeof(std::int64_t);
    for (int r = 0; r < ranks; ++r) {
      void* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, bytes_ + 2 * kGuard), cudaSuccess);
      EXPECT_EQ(cudaMemset(p, kGuardByte, bytes_ + 2 * kGuard), cudaSuccess);
      base_.push_back(static_cast<unsigned char*>(p));
    }
  }
  ~DeviceIds() {
    for (auto* p : base_) cudaFree(p);
  }
  DeviceIds(const DeviceIds&) = delete;
  DeviceIds& operator=(const DeviceIds&) = delete;

  std::int64_t* data(int r) const { return reinterpret_cast<std::int64_t*>(base_[r] + kGuard); }

  void upload(const std::vector<std::vector<std::int64_t>>& ids, cudaStream_t stream = nullptr) {
    for (std::size_t r = 0; r < ids.size(); ++r) {
      EXPECT_EQ(cudaMemcpyAsync(data(static_cast<int>(r)), ids[r].data(), bytes_,
                                cudaMemcpyHostToDevice, stream),
                cudaSuccess);
    }
  }
  std::vector<TensorView> views(int first = 0, int count = -1) const {
    std::vector<TensorView> v;
    if (count < 0) count = static_cast<int>(base_.size());
    for (int r = first; r < first + count; ++r) {
      v.push_back(TensorView::contiguous(data(r), DType::i64, {T_, k_}, {DeviceKind::cuda, 0}));
    }
    return v;
  }
  bool guards_intact() const {
    std::vector<unsigned char> host(kGuard);
    for (auto* p : base_) {
      for (unsigned char* g : {p, p + kGuard + bytes_}) {
        if (cudaMemcpy(host.data(), g, kGuard, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
        for (unsigned char b : host) {
          if (b != kGuardByte) return false;
        }
      }
    }
    return true;
  }

 private:
  std::int64_t T_, k_;
  std::size_t bytes_ = 0;
  std::vector<unsigned char*> base_;
};

struct DeviceSchedule {
  std::vector<std::int32_t> table, expert_counts, expert_src_counts, segment_starts;
  schedule::RingPlan ring_plan;
  std::vector<std::int32_t> row_of_slot;  // the local region's inverse of the table [W*T*k]
};

inline std::vector<std::int32_t> download_i32(const TensorView& v) {
  std::vector<std::int32_t> h(static_cast<std::size_t>(v.numel()));
  EXPECT_EQ(cudaMemcpy(h.data(), v.data, h.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

inline DeviceSchedule download(const Team& team, int rank) {
  const ScheduleViews v = team.schedule(rank);
  DeviceSchedule d;
  d.table = download_i32(v.table);
  d.expert_counts = download_i32(v.expert_counts);
  d.expert_src_counts = download_i32(v.expert_src_counts);
  d.segment_starts = download_i32(v.segment_starts);
  const std::vector<std::int32_t> ring = download_i32(v.ring_plan);
  std::memcpy(&d.ring_plan, ring.data(), sizeof(d.ring_plan));
  // Not part of ScheduleViews: read from the rank's local region at its plan offset.
  const Team::Impl& t = team.impl();
  const plan::Buffer& b = t.plan.row_of_slot;
  d.row_of_slot.resize(static_cast<std::size_t>(b.bytes / 4));
  EXPECT_EQ(cudaMemcpy(d.row_of_slot.data(), t.local[rank - t.first_rank] + b.offset,
                       static_cast<std::size_t>(b.bytes), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return d;
}

// Every rank this team runs, bitwise against the host twin; "" when equal.
inline std::string compare_with_twin(const Team& team,
                                     const std::vector<std::vector<std::int64_t>>& ids) {
  const Problem& p = team.problem();
  const Config& c = team.config();
  std::vector<const std::int64_t*> ptrs;
  for (auto& v : ids) ptrs.push_back(v.data());
  const schedule::Shape shape{p.num_tokens, p.topk, p.num_experts, p.ep_size};
  for (int rank = team.first_rank(); rank < team.first_rank() + team.num_local_ranks(); ++rank) {
    const schedule::HostSchedule want =
        schedule::build_schedule_host(shape, c.macrobatch_size, c.minibatch_size, rank, ptrs);
    const DeviceSchedule got = download(team, rank);
    const std::string r = "rank " + std::to_string(rank) + ": ";
    if (auto d = first_difference(got.table, want.table); !d.empty()) return r + "table" + d;
    if (got.expert_counts != want.expert_counts) return r + "expert_counts differ";
    if (got.expert_src_counts != want.expert_src_counts) return r + "expert_src_counts differ";
    if (got.segment_starts != want.segment_starts) return r + "segment_starts differ";
    if (std::memcmp(&got.ring_plan, &want.ring_plan, sizeof(got.ring_plan)) != 0) {
      return r + "ring_plan differs";
    }
    const std::int64_t slots = std::int64_t{p.ep_size} * shape.slots_per_rank();
    if (auto d = first_difference(got.row_of_slot, inverse_of(want.table, slots)); !d.empty()) {
      return r + "row_of_slot" + d;
    }
  }
  return "";
}

inline Problem schedule_problem(int W, std::int64_t T, std::int64_t k, std::int64_t E,
                                int rank = 0) {
  return {.num_tokens = T,
          .hidden_size = 64,
          .intermediate_size = 64,
          .num_experts = E,
          .topk = k,
          .shared_intermediate_size = 0,
          .ep_size = W,
          .ep_rank = rank};
}

}  // namespace mok::test
