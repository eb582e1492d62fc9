#include "core/schedule_host.hpp"

namespace mok::schedule {

HostSchedule build_schedule_host(const Shape& shape, std::int64_t macrobatch_size,
                                 std::int64_t minibatch_size, int rank,
                                 std::span<const std::int64_t* const> ids_per_rank) {
  const std::int64_t n = shape.slots_per_rank();
  const auto E_local = static_cast<std::int32_t>(shape.num_local_experts());
  const int W = shape.ep_size;
  HostSchedule s;
  s.table.assign(static_cast<std::size_t>(max_schedule_rows(shape)), kPaddingRow);
  s.expert_counts.assign(E_local, 0);
  s.expert_src_counts.assign(static_cast<std::size_t>(E_local) * W, 0);
  s.segment_starts.assign(E_local + 1, 0);

  // The staged ids, exactly as the exchange area holds them (invalid -> unused).
  auto staged = [&](int src, std::int64_t slot) {
    return staged_expert_id(ids_per_rank[src][slot], shape.num_experts);
  };
  for (int src = 0; src < W && !s.first_bad; ++src) {
    for (std::int64_t slot = 0; slot < n; ++slot) {
      const std::int64_t v = ids_per_rank[src][slot];
      if (!is_valid_expert_id(v, shape.num_experts)) {
        s.first_bad =
            BadSlot{src, slot / shape.topk, static_cast<std::int32_t>(slot % shape.topk), v};
        break;
      }
    }
  }

  for (int src = 0; src < W; ++src) {
    for (std::int64_t slot = 0; slot < n; ++slot) {
      const std::int32_t e = local_expert_of(staged(src, slot), rank, E_local);
      if (e >= 0) ++s.expert_src_counts[static_cast<std::size_t>(e) * W + src];
    }
  }
  std::int64_t start = 0;
  for (std::int32_t e = 0; e < E_local; ++e) {
    std::int64_t count = 0;
    for (int src = 0; src < W; ++src)
      count += s.expert_src_counts[static_cast<std::size_t>(e) * W + src];
    s.expert_counts[e] = static_cast<std::int32_t>(count);
    s.segment_starts[e] = static_cast<std::int32_t>(start);
    start += padded_rows(count);
  }
  s.segment_starts[E_local] = static_cast<std::int32_t>(start);

  // Placement: walking (src, t, j) in order and appending to each expert's segment gives the
  // canonical order expert-major, then src_rank, then t, then j.
  std::vector<std::int64_t> cursor(s.segment_starts.begin(), s.segment_starts.end() - 1);
  for (int src = 0; src < W; ++src) {
    for (std::int64_t slot = 0; slot < n; ++slot) {
      const std::int32_t e = local_expert_of(staged(src, slot), rank, E_local);
      if (e >= 0) s.table[cursor[e]++] = encode_row(src, slot, n);
    }
  }
  s.ring_plan =
      make_ring_plan(start, macrobatch_rows(shape, macrobatch_size, minibatch_size), minibatch_size);
  return s;
}

}  // namespace mok::schedule
