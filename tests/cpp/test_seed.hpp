// Random inputs of the C++ tests: one seed a run, printed by every test that draws from it,
// replayed with MOK_TEST_SEED. Every C++ test binary links test_seed.cpp, which defines these.
//
// The run's seed is MOK_TEST_SEED when it is set (a decimal integer), else a fresh one. Every test
// of the run sees that seed (test_seed()); a test that wants several independent streams (a
// buffer each, say) draws them with next_seed(), whose count starts again at every test's start.
// So a test's inputs depend only on the seed and the test itself, never on which tests ran before
// it in the process, and a failure replays alone:
//
//   MOK_TEST_SEED=<n> build/tests/cpp/<binary> --gtest_filter=<Suite.Name>
//
// (ctest runs each test in a process of its own: every test there has its own seed.) A test's
// first draw prints "[ mok ] random inputs from MOK_TEST_SEED=<n> (<Suite.Name>)" and records the
// seed as the test's property `mok_seed` (in --gtest_output=xml or json reports); a test that drew
// it and failed prints the replay command above as it ends.
#pragma once

#include <cstdint>

namespace mok::test {

// The run's seed (MOK_TEST_SEED, or fresh). Throws std::invalid_argument when MOK_TEST_SEED is
// not a decimal integer (the test that asks fails with that message).
std::uint64_t test_seed();

// The next of this test's independent seeds: a hash of (test_seed(), i) for the test's i-th call,
// i from 0 at every test's start. Draw them on the test's own thread, in a fixed order, so a
// replay draws the same ones.
std::uint64_t next_seed();

}  // namespace mok::test
