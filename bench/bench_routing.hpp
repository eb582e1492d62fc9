// The routing of the layer benchmarks (bench_virtual_ranks, bench_dispatch): every token takes k
// distinct experts of E, drawn uniformly; skewed, a token's first expert is expert 0 with
// probability 1/2, so expert 0 holds about half the tokens (PERF.md's skewed cases).
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace mok::bench {

inline std::vector<std::int64_t> routing(std::int64_t T, std::int64_t k, std::int64_t E,
                                         bool skewed, std::mt19937_64& rng) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(T * k));
  for (std::int64_t t = 0; t < T; ++t) {
    const auto first = ids.begin() + t * k;
    for (std::int64_t j = 0; j < k;) {
      const std::int64_t e =
          skewed && j == 0 && rng() % 2 == 0 ? 0 : static_cast<std::int64_t>(rng() % E);
      if (std::find(first, first + j, e) == first + j) first[j++] = e;
    }
  }
  return ids;
}

}  // namespace mok::bench
