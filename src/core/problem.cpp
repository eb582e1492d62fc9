#include "mok/problem.hpp"

#include <sstream>

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
