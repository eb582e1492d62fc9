// The schedule's public entry points that need no GPU: sizes, the CPU backend, argument checks
// shared with the CUDA entry points (src/core/schedule_check.hpp).
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/schedule_check.hpp"
#include "core/schedule_host.hpp"
#include "core/validate.hpp"
#include "core/workspace_plan.hpp"
#include "mok/schedule.hpp"

namespace mok {

int schedule_segment_alignment() {
  return schedule::kExpertSegmentAlignment;
}

std::int64_t schedule_capacity_rows(const Problem& p) {
  return schedule::max_schedule_rows(schedule_shape_of(p));
}

schedule::Shape schedule_shape_of(const Problem& p) {
  return {p.num_tokens, p.topk, p.num_experts, p.ep_size};
}

plan::PlanShape plan_shape_of(const Problem& p, const Config& c) {
  return {.num_tokens = p.num_tokens,
          .hidden_size = p.hidden_size,
          .topk = p.topk,
          .num_experts = p.num_experts,
          .ep_size = p.ep_size,
          .macrobatch_size = schedule::macrobatch_rows(schedule_shape_of(p), c.macrobatch_size,
                                                     c.minibatch_size),
          .minibatch_size = c.minibatch_size,
          .intermediate_size = p.intermediate_size,
          .shared_intermediate_size = p.shared_intermediate_size};
}

void validate_schedule_problem(const Problem& p, const Config& c) {
  // f64 skips the bf16 size alignment: the schedule does not depend on H or I.
  p.validate(DType::f64);
  c.validate();
  if (p.ep_size > schedule::kMaxRanks) {
    throw Error("ep_size", "at most " + std::to_string(schedule::kMaxRanks), to_text(p.ep_size));
  }
  // Problem::validate bounds the table's rows (int32 row ids); the ring is the config's.
  constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
  const std::int64_t ring =
      schedule::macrobatch_rows(schedule_shape_of(p), c.macrobatch_size, c.minibatch_size);
  if (ring > kInt32Max) {
    throw Error("config.macrobatch_size", "a ring of at most 2^31 - 1 rows",
                to_text(ring) + " rows");
  }
}

std::int64_t symmetric_workspace_bytes(const Problem& p, const Config& c) {
  validate_schedule_problem(p, c);
  return plan::make_workspace_plan(plan_shape_of(p, c)).symmetric_bytes;
}

std::int64_t local_workspace_bytes(const Problem& p, const Config& c) {
  validate_schedule_problem(p, c);
  return plan::make_workspace_plan(plan_shape_of(p, c)).local_bytes;
}

void check_schedule_views(const Problem& p, const ScheduleViews& out, Device device) {
  const std::int64_t E_local = p.num_local_experts();
  check_view("schedule.table", out.table, DType::i32, {schedule_capacity_rows(p)}, device);
  check_view("schedule.expert_counts", out.expert_counts, DType::i32, {E_local}, device);
  check_view("schedule.expert_src_counts", out.expert_src_counts, DType::i32,
             {E_local, std::int64_t{p.ep_size}}, device);
  check_view("schedule.segment_starts", out.segment_starts, DType::i32, {E_local + 1}, device);
  check_view("schedule.ring_plan", out.ring_plan, DType::i32, {kRingPlanInts}, device);
}

void check_topk_experts_list(const Problem& p, std::span<const TensorView> ids,
                             std::size_t expected_count, Device device, const char* what) {
  if (ids.size() != expected_count) {
    throw Error("topk_experts", std::to_string(expected_count) + " tensors (" + what + ")",
                to_text(ids.size()));
  }
  for (std::size_t r = 0; r < ids.size(); ++r) {
    const std::string name = "topk_experts[rank " + std::to_string(r) + "]";
    check_view(name.c_str(), ids[r], DType::i64, {p.num_tokens, p.topk}, device);
  }
}

std::string bad_expert_id_argument(int rank, std::int64_t token, std::int64_t slot) {
  return "topk_experts[" + std::to_string(token) + ", " + std::to_string(slot) + "] of rank " +
         std::to_string(rank);
}

std::string expert_id_range_text(std::int64_t num_experts) {
  return "an expert id in [-1, " + std::to_string(num_experts) + ")";
}

void build_schedule_cpu(const Problem& p, const Config& config,
                        std::span<const TensorView> topk_experts_per_rank,
                        const ScheduleViews& out) {
  validate_schedule_problem(p, config);
  const Device cpu{DeviceKind::cpu, 0};
  check_topk_experts_list(p, topk_experts_per_rank, static_cast<std::size_t>(p.ep_size), cpu,
                          "one per rank of the EP group");
  check_schedule_views(p, out, cpu);
  std::vector<const std::int64_t*> ids;
  for (const TensorView& v : topk_experts_per_rank) ids.push_back(v.ptr<const std::int64_t>());
  const schedule::HostSchedule s = schedule::build_schedule_host(
      schedule_shape_of(p), config.macrobatch_size, config.minibatch_size, p.ep_rank, ids);
  if (s.first_bad) {
    throw Error(bad_expert_id_argument(s.first_bad->rank, s.first_bad->token, s.first_bad->slot),
                expert_id_range_text(p.num_experts), to_text(s.first_bad->value));
  }
  auto copy = [](const std::vector<std::int32_t>& from, const TensorView& to) {
    std::copy(from.begin(), from.end(), to.ptr<std::int32_t>());
  };
  copy(s.table, out.table);
  copy(s.expert_counts, out.expert_counts);
  copy(s.expert_src_counts, out.expert_src_counts);
  copy(s.segment_starts, out.segment_starts);
  std::memcpy(out.ring_plan.data, &s.ring_plan, sizeof(s.ring_plan));
}

}  // namespace mok
