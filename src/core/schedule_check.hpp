// Argument checks and conversions shared by the CPU and CUDA entry points of the schedule.
#pragma once

#include <span>
#include <string>

#include "core/schedule_layout.hpp"
#include "core/workspace_plan.hpp"
#include "mok/schedule.hpp"

namespace mok {

schedule::Shape schedule_shape_of(const Problem& p);
plan::PlanShape plan_shape_of(const Problem& p, const Config& c);

// Problem and Config as the schedule needs them: Problem::validate (any H), Config::validate,
// ep_size <= kMaxRanks, the table's rows fit int32.
void validate_schedule_problem(const Problem& p, const Config& c);

void check_schedule_views(const Problem& p, const ScheduleViews& out, Device device);

// `expected_count` int64 [T, k] views on `device`; `what` says why that many.
void check_topk_experts_list(const Problem& p, std::span<const TensorView> ids,
                             std::size_t expected_count, Device device, const char* what);

// The wording of a bad-id error, the same from the CPU check and from the device record.
std::string bad_expert_id_argument(int rank, std::int64_t token, std::int64_t slot);
std::string expert_id_range_text(std::int64_t num_experts);

}  // namespace mok
