// The tests' one seed mechanism (test_seed.hpp says how to use and replay it). Linked into every
// C++ test binary: a gtest listener, registered here before main, starts each test's count of
// draws at zero, and prints the replay command when a test that drew the seed fails.
#include "test_seed.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>

namespace mok::test {
namespace {

std::uint64_t parse_seed(const char* text) {
  const std::string s(text);
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || *end != '\0' ||
      errno == ERANGE) {
    throw std::invalid_argument("MOK_TEST_SEED: expected a decimal integer below 2^64, got \"" + s +
                                "\"");
  }
  return v;
}

std::uint64_t run_seed() {
  // A throw (bad MOK_TEST_SEED) leaves it uninitialized: every test that asks fails the same way.
  static const std::uint64_t seed = [] {
    if (const char* s = std::getenv("MOK_TEST_SEED")) return parse_seed(s);
    const auto now = std::chrono::system_clock::now().time_since_epoch().count();
    return std::uint64_t{std::random_device{}() ^ static_cast<std::uint32_t>(now)};
  }();
  return seed;
}

// What the running test has drawn: whether it asked for the seed, and how many next_seed() calls.
struct Draws {
  std::mutex mutex;
  bool seed_used = false;
  std::uint64_t count = 0;
};

Draws& draws() {
  static Draws d;
  return d;
}

std::string test_name(const ::testing::TestInfo& info) {
  return std::string(info.test_suite_name()) + "." + info.name();
}

// The first use of the seed in a test: print it and record it in the test's report. Called with
// draws().mutex held.
void note_use(std::uint64_t seed) {
  Draws& d = draws();
  if (d.seed_used) return;
  d.seed_used = true;
  const auto n = static_cast<unsigned long long>(seed);
  if (const auto* info = ::testing::UnitTest::GetInstance()->current_test_info()) {
    std::printf("[ mok ] random inputs from MOK_TEST_SEED=%llu (%s)\n", n,
                test_name(*info).c_str());
    ::testing::Test::RecordProperty("mok_seed", std::to_string(seed));
  } else {  // outside a test (a suite's set-up): printed once until the next test starts
    std::printf("[ mok ] random inputs from MOK_TEST_SEED=%llu\n", n);
  }
  std::fflush(stdout);
}

const char* program_name() {
#if defined(__GLIBC__)
  return program_invocation_name;
#else
  return "<test binary>";
#endif
}

class SeedListener : public ::testing::EmptyTestEventListener {
  void OnTestStart(const ::testing::TestInfo&) override {
    std::lock_guard<std::mutex> lock(draws().mutex);
    draws().seed_used = false;
    draws().count = 0;
  }
  // Runs before the default printer's "[  FAILED  ]" line (gtest calls end events in reverse).
  void OnTestEnd(const ::testing::TestInfo& info) override {
    std::lock_guard<std::mutex> lock(draws().mutex);
    if (!draws().seed_used || !info.result()->Failed()) return;
    const auto n = static_cast<unsigned long long>(run_seed());
    std::printf(
        "[ mok ] %s failed with MOK_TEST_SEED=%llu; replay it alone with:\n"
        "[ mok ]   MOK_TEST_SEED=%llu %s --gtest_filter='%s'\n",
        test_name(info).c_str(), n, n, program_name(), test_name(info).c_str());
    std::fflush(stdout);
  }
};

// Registered during static initialization, before gtest_main parses flags and runs the tests.
[[maybe_unused]] const bool kListening = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new SeedListener);
  return true;
}();

std::uint64_t splitmix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

std::uint64_t test_seed() {
  const std::uint64_t seed = run_seed();
  std::lock_guard<std::mutex> lock(draws().mutex);
  note_use(seed);
  return seed;
}

std::uint64_t next_seed() {
  const std::uint64_t seed = run_seed();
  std::lock_guard<std::mutex> lock(draws().mutex);
  note_use(seed);
  const std::uint64_t i = draws().count++;
  return splitmix64(seed + (i + 1) * 0x9E3779B97F4A7C15ull);
}

}  // namespace mok::test
