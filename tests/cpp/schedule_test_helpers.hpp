// Routings and an independent re-derivation of the schedule, for the schedule tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/schedule_host.hpp"
#include "core/schedule_layout.hpp"
#include "test_seed.hpp"

namespace mok::test {

enum class RoutingKind { uniform, zipf, one_expert, empty_experts, unused_slots, repeated };
inline constexpr RoutingKind kAllRoutings[] = {
    RoutingKind::uniform,       RoutingKind::zipf,         RoutingKind::one_expert,
    RoutingKind::empty_experts, RoutingKind::unused_slots, RoutingKind::repeated};

inline const char* routing_kind_name(RoutingKind r) {
  switch (r) {
    case RoutingKind::uniform:
      return "uniform";
    case RoutingKind::zipf:
      return "zipf";
    case RoutingKind::one_expert:
      return "one-expert";
    case RoutingKind::empty_experts:
      return "empty-experts";
    case RoutingKind::unused_slots:
      return "unused-slots";
    case RoutingKind::repeated:
      return "repeated";
  }
  return "?";
}

// k ids per token from `weights` (over experts 0..E-1) without replacement, as a router does;
// with replacement when fewer than k experts have weight.
inline void draw_distinct(const std::vector<double>& weights, std::int64_t k, std::mt19937_64& rng,
                          std::int64_t* out) {
  std::vector<double> w = weights;
  const auto available = std::count_if(w.begin(), w.end(), [](double x) { return x > 0; });
  for (std::int64_t j = 0; j < k; ++j) {
    std::discrete_distribution<std::int64_t> pick(w.begin(), w.end());
    out[j] = pick(rng);
    if (available >= k) w[out[j]] = 0;
  }
}

// One rank's [T, k] ids. `one_expert_id` is the expert every slot goes to for one_expert.
inline std::vector<std::int64_t> make_routing(RoutingKind kind, std::int64_t T, std::int64_t k,
                                              std::int64_t E, std::int64_t one_expert_id,
                                              std::mt19937_64& rng) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(T * k));
  std::vector<double> w(static_cast<std::size_t>(E), 1.0);
  if (kind == RoutingKind::zipf) {
    std::vector<std::int64_t> perm(E);
    for (std::int64_t e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (std::int64_t i = 0; i < E; ++i) w[perm[i]] = 1.0 / std::pow(double(i + 1), 1.2);
  } else if (kind == RoutingKind::empty_experts) {
    // Only every third expert is ever chosen: most experts of every rank stay empty.
    for (std::int64_t e = 0; e < E; ++e) w[e] = e % 3 == 0 ? 1.0 : 0.0;
  }
  std::uniform_real_distribution<double> u(0, 1);
  std::uniform_int_distribution<std::int64_t> any(0, E - 1);
  for (std::int64_t t = 0; t < T; ++t) {
    std::int64_t* row = ids.data() + t * k;
    switch (kind) {
      case RoutingKind::one_expert:
        std::fill(row, row + k, one_expert_id);
        break;
      case RoutingKind::repeated:
        for (std::int64_t j = 0; j < k; ++j) row[j] = j > 0 && u(rng) < 0.4 ? row[j - 1] : any(rng);
        break;
      default:
        draw_distinct(w, k, rng, row);
        if (kind == RoutingKind::unused_slots) {
          const bool whole_token = u(rng) < 0.1;
          for (std::int64_t j = 0; j < k; ++j) {
            if (whole_token || u(rng) < 0.3) row[j] = -1;
          }
        }
    }
  }
  return ids;
}

// The schedule of `rank` derived directly from the definition (DESIGN.md section 2), without the
// host twin's code: per global expert, the list of (src_rank, t, j) in order.
struct DirectSchedule {
  std::vector<std::int32_t> table, expert_counts, expert_src_counts, segment_starts;
  std::int64_t total_rows = 0;
};

inline DirectSchedule derive_schedule(const std::vector<std::vector<std::int64_t>>& ids,
                                      std::int64_t T, std::int64_t k, std::int64_t E, int rank) {
  const int W = static_cast<int>(ids.size());
  const std::int64_t E_local = E / W, n = T * k;
  std::vector<std::vector<std::int32_t>> rows(static_cast<std::size_t>(E_local));
  DirectSchedule d;
  d.expert_src_counts.assign(static_cast<std::size_t>(E_local * W), 0);
  for (int src = 0; src < W; ++src) {
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t g = ids[src][t * k + j];
        if (g >= rank * E_local && g < (rank + 1) * E_local) {
          rows[g - rank * E_local].push_back(static_cast<std::int32_t>(src * n + t * k + j));
          ++d.expert_src_counts[(g - rank * E_local) * W + src];
        }
      }
    }
  }
  for (std::int64_t e = 0; e < E_local; ++e) {
    d.segment_starts.push_back(static_cast<std::int32_t>(d.table.size()));
    d.expert_counts.push_back(static_cast<std::int32_t>(rows[e].size()));
    d.table.insert(d.table.end(), rows[e].begin(), rows[e].end());
    while (d.table.size() % 128 != 0) d.table.push_back(-1);
  }
  d.total_rows = static_cast<std::int64_t>(d.table.size());
  d.segment_starts.push_back(static_cast<std::int32_t>(d.table.size()));
  d.table.resize(static_cast<std::size_t>(W * n + E_local * 127), -1);
  return d;
}

// The expected ring plan, computed the long way (a loop over passes and minibatches).
inline schedule::RingPlan derive_ring_plan(std::int64_t total, std::int64_t macro,
                                           std::int64_t mini) {
  schedule::RingPlan p;
  p.total_rows = static_cast<std::int32_t>(total);
  p.macrobatch_rows = static_cast<std::int32_t>(macro);
  p.minibatch_rows = static_cast<std::int32_t>(mini);
  p.minibatches_per_pass = static_cast<std::int32_t>(macro / mini);
  for (std::int64_t begin = 0; begin < total; begin += macro) {
    ++p.num_passes;
    const std::int64_t rows = std::min(macro, total - begin);
    p.last_pass_rows = static_cast<std::int32_t>(rows);
    for (std::int64_t m = 0; m < rows; m += mini) ++p.num_minibatches;
  }
  return p;
}

inline bool same_ring_plan(const schedule::RingPlan& a, const schedule::RingPlan& b) {
  return a.total_rows == b.total_rows && a.num_passes == b.num_passes &&
         a.macrobatch_rows == b.macrobatch_rows && a.minibatch_rows == b.minibatch_rows &&
         a.minibatches_per_pass == b.minibatches_per_pass &&
         a.num_minibatches == b.num_minibatches && a.last_pass_rows == b.last_pass_rows &&
         a.reserved == b.reserved;
}

// First index where two vectors differ, as text ("" when equal).
template <typename T>
std::string first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) {
    return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) {
      return "[" + std::to_string(i) + "]: " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
    }
  }
  return "";
}

// The test grid of issue 4.
struct GridCase {
  int W;
  std::int64_t T, k, E;
  std::int64_t macrobatch, minibatch;
};

inline std::vector<GridCase> schedule_grid() {
  std::vector<GridCase> cases;
  const std::int64_t local_experts[] = {1, 5, 16, 40};
  const std::int64_t rings[][2] = {{131072, 4096}, {1024, 256}, {384, 128}, {1152, 384}};
  int i = 0;
  for (int W : {1, 2, 3, 4, 8}) {
    for (std::int64_t T : {1, 7, 4096}) {
      for (std::int64_t k : {1, 2, 8}) {
        std::int64_t E_local = local_experts[i % 4];
        E_local = std::max(E_local, (k + W - 1) / W);  // E >= k
        const auto* ring = rings[(i / 4 + i) % 4];
        cases.push_back({W, T, k, W * E_local, ring[0], ring[1]});
        ++i;
      }
    }
  }
  return cases;
}

inline std::string case_name(const GridCase& c, RoutingKind r) {
  return "W" + std::to_string(c.W) + " T" + std::to_string(c.T) + " k" + std::to_string(c.k) +
         " E" + std::to_string(c.E) + " ring " + std::to_string(c.macrobatch) + "/" +
         std::to_string(c.minibatch) + " " + routing_kind_name(r);
}

// The table inverted: want[src] = the row whose source is src, -1 for a slot with no row here.
inline std::vector<std::int32_t> inverse_of(const std::vector<std::int32_t>& table,
                                            std::int64_t slots) {
  std::vector<std::int32_t> want(static_cast<std::size_t>(slots), -1);
  for (std::size_t row = 0; row < table.size(); ++row) {
    if (table[row] >= 0) want[static_cast<std::size_t>(table[row])] = static_cast<std::int32_t>(row);
  }
  return want;
}

}  // namespace mok::test
