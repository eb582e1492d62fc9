// The team barrier's self-test (tests only): `rounds` team barriers with a random delay of up to
// `max_delay_ns` per rank, block and round before each; after each barrier every block checks
// every peer block's payload for that round. Ranks equal to `missing_rank` skip the test entirely
// (so the others must time out). Returns the number of payload mismatches seen; device errors
// are raised as mok::Error. The payload lives in memory of its own, so every rank of the team
// must be in this process (a local virtual team, or an external team over regions of this
// process). Synchronizes.
#pragma once

#include <cstdint>

#include "cuda/comm/team.hpp"

namespace mok::test {

std::int64_t team_selftest(Team& team, int rounds, int blocks_per_rank, std::uint32_t max_delay_ns,
                           std::uint64_t seed, int missing_rank = -1);

}  // namespace mok::test
