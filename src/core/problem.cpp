#include "mok/problem.hpp"

#include <algorithm>
#include <sstream>
#include <utility>

#include "core/schedule_layout.hpp"
#include "mok/error.hpp"

namespace mok {

double Problem::forward_flops(std::int64_t routed_rows) const {
  const double routed = 2.0 * routed_rows * 3.0 * hidden_size * intermediate_size;
  const double shared = 2.0 * num_tokens * 3.0 * hidden_size * shared_intermediate_size;
  return routed + shared;
}

static void require_positive(const char* name, std::int64_t v) {
  if (v <= 0) throw Error(name, "a positive integer", to_text(v));
}

static void require_at_most(const char* name, std::int64_t v, std::int64_t bound, const char* why) {
  if (v > bound) throw Error(name, "at most " + to_text(bound) + " (" + why + ")", to_text(v));
}

// a * b for non-negative a, b, saturated at kMaxElements + 1 (so that no product overflows).
static std::int64_t product(std::int64_t a, std::int64_t b) {
  if (a != 0 && b > (kMaxElements + 1) / a) return kMaxElements + 1;
  return std::min(a * b, kMaxElements + 1);
}

void Problem::validate(DType activation_dtype) const {
  require_positive("num_tokens", num_tokens);
  require_positive("hidden_size", hidden_size);
  require_positive("intermediate_size", intermediate_size);
  require_positive("num_experts", num_experts);
  require_positive("topk", topk);
  if (shared_intermediate_size < 0) {
    throw Error("shared_intermediate_size", "0 (no shared expert) or a positive integer",
                to_text(shared_intermediate_size));
  }
  constexpr const char* kInt32 = "the kernels index with 32-bit ints";
  require_at_most("num_tokens", num_tokens, kMaxSize, kInt32);
  require_at_most("hidden_size", hidden_size, kMaxSize, kInt32);
  require_at_most("intermediate_size", intermediate_size, kMaxSize, kInt32);
  require_at_most("shared_intermediate_size", shared_intermediate_size, kMaxSize, kInt32);
  require_at_most("topk", topk, kMaxSize, kInt32);
  require_at_most("num_experts", num_experts, kMaxExperts,
                  "mok's bound: each expert pads the schedule to a 128-row tile");
  if (topk > num_experts) {
    throw Error("topk", "at most num_experts = " + to_text(num_experts), to_text(topk));
  }
  if (ep_size <= 0) throw Error("ep_size", "a positive integer", to_text(ep_size));
  if (num_experts % ep_size != 0) {
    throw Error("num_experts", "a multiple of ep_size = " + to_text(ep_size), to_text(num_experts));
  }
  if (ep_rank < 0 || ep_rank >= ep_size) {
    throw Error("ep_rank", "in [0, " + to_text(ep_size) + ")", to_text(ep_rank));
  }
  // Products, each of sizes already bounded (no overflow: product() saturates).
  const std::int64_t E_local = num_local_experts();
  const std::int64_t routed_rows = product(product(ep_size, num_tokens), topk);
  const std::int64_t table_rows =
      routed_rows + E_local * (schedule::kExpertSegmentAlignment - 1);  // E_local <= 2^20
  require_at_most("ep_size * num_tokens * topk (with each local expert's padding)", table_rows,
                  kMaxSize, "the schedule table's row ids are 32-bit");
  require_at_most("num_local_experts * max(hidden_size, intermediate_size)",
                  product(E_local, std::max(hidden_size, intermediate_size)), kMaxSize,
                  "a weight's tensor-map rows are 32-bit coordinates");
  const std::int64_t width = std::max(hidden_size, intermediate_size);
  const std::pair<const char*, std::int64_t> elements[] = {
      {"num_local_experts * intermediate_size * hidden_size",
       product(product(E_local, intermediate_size), hidden_size)},
      {"num_tokens * max(hidden_size, shared_intermediate_size)",
       product(num_tokens, std::max(hidden_size, shared_intermediate_size))},
      {"routed rows * max(hidden_size, intermediate_size)", product(table_rows, width)},
  };
  for (const auto& [name, n] : elements) {
    require_at_most(name, n, kMaxElements, "a tensor's bytes must fit an int64");
  }
  if (activation_dtype == DType::bf16) {
    const std::string multiple = "a multiple of " + to_text(kBf16SizeAlignment) + " for bfloat16";
    if (hidden_size % kBf16SizeAlignment)
      throw Error("hidden_size", multiple, to_text(hidden_size));
    if (intermediate_size % kBf16SizeAlignment) {
      throw Error("intermediate_size", multiple, to_text(intermediate_size));
    }
    if (shared_intermediate_size % kBf16SizeAlignment) {
      throw Error("shared_intermediate_size", "0 or " + multiple,
                  to_text(shared_intermediate_size));
    }
  } else if (activation_dtype != DType::f64) {
    throw Error("activation dtype", "bfloat16 (or float64 on the CPU backend)",
                dtype_name(activation_dtype));
  }
}

std::string Problem::to_string() const {
  std::ostringstream s;
  s << "T=" << num_tokens << " H=" << hidden_size << " I=" << intermediate_size
    << " E=" << num_experts << " k=" << topk << " S=" << shared_intermediate_size
    << " W=" << ep_size << " rank=" << ep_rank;
  return s.str();
}

}  // namespace mok
