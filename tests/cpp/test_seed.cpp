#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "layer_helpers.hpp"

namespace mok::test {

std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* s = std::getenv("MOK_TEST_SEED")) return std::strtoull(s, nullptr, 10);
    const auto now = std::chrono::system_clock::now().time_since_epoch().count();
    return static_cast<std::uint64_t>(now) % 1000000007ull;
  }();
  static bool printed = false;
  if (!printed) {
    std::printf("[ mok ] random inputs from MOK_TEST_SEED=%llu\n",
                static_cast<unsigned long long>(seed));
    printed = true;
  }
  return seed;
}

}  // namespace mok::test
