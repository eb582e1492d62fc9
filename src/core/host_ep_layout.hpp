// The exchange rows of host expert parallelism (include/mok/host_ep.hpp): which row of the
// buffers that move between ranks holds each slot. One definition for the API's checks and the
// CPU reference.
//
// Gathered slot g = (q*T + t)*k + j is rank q's token t, slot j (every rank's topk_experts in rank
// order). Expert e lives on rank e / E_local.
//
//   send buffer of rank r [sum_q send[q], ...]: the slots this rank's experts computed, in
//     increasing gathered slot order, so home rank q's rows come together (rows [sum_{q'<q}
//     send[q'], + send[q])) and, within them, in (t, j) order.
//   receive buffer of rank r [sum_q receive[q], ...]: rank r's slots, grouped by the rank q that
//     owns their expert (q increasing), each group in (t, j) order: exactly what q sent to r.
//
// An all-to-all with send splits `send` and receive splits `receive` moves the one into the other.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/host_ep.hpp"
#include "mok/problem.hpp"

namespace mok::host_ep {

inline bool is_local(const Problem& p, std::int64_t e) {
  return e >= p.first_local_expert() && e < p.first_local_expert() + p.num_local_experts();
}

// From every rank's ids (`ids_all`: [W*T, k], valid).
inline ExchangeCounts exchange_counts(const Problem& p, const std::int64_t* ids_all) {
  const std::int64_t slots_per_rank = p.num_tokens * p.topk, E_local = p.num_local_experts();
  ExchangeCounts c{std::vector<std::int64_t>(p.ep_size, 0),
                   std::vector<std::int64_t>(p.ep_size, 0)};
  for (int q = 0; q < p.ep_size; ++q) {
    for (std::int64_t s = 0; s < slots_per_rank; ++s) {
      if (is_local(p, ids_all[q * slots_per_rank + s])) ++c.send[q];
    }
  }
  const std::int64_t* own = ids_all + p.ep_rank * slots_per_rank;
  for (std::int64_t s = 0; s < slots_per_rank; ++s) {
    if (own[s] >= 0) ++c.receive[own[s] / E_local];
  }
  return c;
}

// Rows of this rank's receive buffer, from its own ids alone: its used slots.
inline std::int64_t received_rows(const Problem& p, const std::int64_t* ids) {
  std::int64_t n = 0;
  for (std::int64_t s = 0; s < p.num_tokens * p.topk; ++s) n += ids[s] >= 0 ? 1 : 0;
  return n;
}

// For every gathered slot, its row in this rank's send buffer, or -1 (another rank's expert, or
// unused).
inline std::vector<std::int64_t> send_rows(const Problem& p, const std::int64_t* ids_all) {
  const std::int64_t n = std::int64_t{p.ep_size} * p.num_tokens * p.topk;
  std::vector<std::int64_t> rows(static_cast<std::size_t>(n), -1);
  std::int64_t next = 0;
  for (std::int64_t g = 0; g < n; ++g) {
    if (is_local(p, ids_all[g])) rows[g] = next++;
  }
  return rows;
}

// For each of this rank's slots (`ids`: its own [T, k], valid), its row in the receive buffer, or
// -1 (unused).
inline std::vector<std::int64_t> receive_rows(const Problem& p, const std::int64_t* ids) {
  const std::int64_t n = p.num_tokens * p.topk, E_local = p.num_local_experts();
  std::vector<std::int64_t> start(p.ep_size + 1, 0);
  for (std::int64_t s = 0; s < n; ++s) {
    if (ids[s] >= 0) ++start[ids[s] / E_local + 1];
  }
  for (int q = 0; q < p.ep_size; ++q) start[q + 1] += start[q];
  std::vector<std::int64_t> rows(static_cast<std::size_t>(n), -1);
  for (std::int64_t s = 0; s < n; ++s) {
    if (ids[s] >= 0) rows[s] = start[ids[s] / E_local]++;
  }
  return rows;
}

}  // namespace mok::host_ep
