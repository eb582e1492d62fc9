#include "mok/config.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/schedule_layout.hpp"
#include "mok/error.hpp"

namespace mok {

void Config::validate() const {
  if (fwd_num_comm_sms < 1) {
    throw Error("config.fwd_num_comm_sms", "at least 1", to_text(fwd_num_comm_sms));
  }
  if (bwd_num_comm_sms < 1) {
    throw Error("config.bwd_num_comm_sms", "at least 1", to_text(bwd_num_comm_sms));
  }
  if (minibatch_size < 1) {
    throw Error("config.minibatch_size", "a positive number of rows", to_text(minibatch_size));
  }
  // NOTES: GEMM tiles (and expert segments) are kExpertSegmentAlignment rows; with minibatches
  // and passes made of whole tiles, no tile straddles two of them.
  if (minibatch_size % schedule::kExpertSegmentAlignment != 0) {
    throw Error(
        "config.minibatch_size",
        "a multiple of " + to_text(schedule::kExpertSegmentAlignment) + " rows (the GEMM tile)",
        to_text(minibatch_size));
  }
  if (macrobatch_size != 0 && macrobatch_size < minibatch_size) {
    throw Error("config.macrobatch_size",
                "at least config.minibatch_size = " + to_text(minibatch_size),
                to_text(macrobatch_size));
  }
  if (macrobatch_size % minibatch_size != 0) {
    throw Error("config.macrobatch_size",
                "a multiple of config.minibatch_size = " + to_text(minibatch_size),
                to_text(macrobatch_size));
  }
  if (!(std::isfinite(schedule_capacity_multiplier) && schedule_capacity_multiplier > 0)) {
    throw Error("config.schedule_capacity_multiplier", "a finite positive number",
                to_text(schedule_capacity_multiplier));
  }
  if (forward_path != ForwardPath::launches && forward_path != ForwardPath::fused) {
    throw Error("config.forward_path", "launches or fused",
                to_text(static_cast<int>(forward_path)));
  }
  if (fused_stage_rows < 0 || fused_stage_rows % schedule::kExpertSegmentAlignment != 0) {
    throw Error("config.fused_stage_rows",
                "0 (automatic) or a positive multiple of " +
                    to_text(schedule::kExpertSegmentAlignment) + " rows",
                to_text(fused_stage_rows));
  }
}

const char* forward_path_name(ForwardPath p) {
  switch (p) {
    case ForwardPath::launches:
      return "launches";
    case ForwardPath::fused:
      return "fused";
  }
  return "?";
}

std::int64_t Config::resolved_fused_stage_rows() const {
  return fused_stage_rows != 0 ? fused_stage_rows : std::max(minibatch_size, kFusedStageRows);
}

std::string Config::to_string() const {
  std::ostringstream s;
  s << "fwd_num_comm_sms=" << fwd_num_comm_sms << " bwd_num_comm_sms=" << bwd_num_comm_sms
    << " minibatch_size=" << minibatch_size << " macrobatch_size=" << macrobatch_size
    << " schedule_capacity_multiplier=" << schedule_capacity_multiplier
    << " forward_path=" << forward_path_name(forward_path)
    << " fused_stage_rows=" << fused_stage_rows;
  return s.str();
}

}  // namespace mok
