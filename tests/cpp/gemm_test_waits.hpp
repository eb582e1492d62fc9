// The waits of the GEMM tests' launches (mok_gemm_tests: test_gemm.cu's bf16 forms and
// test_gemm_fp8.cu's e4m3 forms), but those of the tests of waits that give up, which bring their
// own. A launch that gives up on a wait (WaitOptions::timeout_ns) ends normally with its outputs
// void, so without a report a test would see only wrong bits: every such launch hands the
// binary's one report, which test_gemm.cu's listener reads after each test (naming the test whose
// launch gave up, and failing the binary). MOK_TEST_GEMM_TIMEOUT_S (seconds, default 20 as in
// production) lengthens the waits for runs under compute-sanitizer, where a launch runs hundreds
// of times slower and a legitimate wait can pass 20 s.
#pragma once

#include <cstdint>
#include <cstdlib>

#include "cuda/gemm/grouped_gemm.hpp"

namespace mok::test {

inline mok::gemm::TimeoutReport& gemm_test_report() {
  static mok::gemm::TimeoutReport report;
  return report;
}

inline std::uint64_t gemm_test_timeout_ns() {
  static const std::uint64_t ns = [] {
    const char* text = std::getenv("MOK_TEST_GEMM_TIMEOUT_S");
    const long long s = text != nullptr ? std::atoll(text) : 0;
    return s > 0 ? std::uint64_t(s) * 1000000000ull : mok::gemm::WaitOptions{}.timeout_ns;
  }();
  return ns;
}

inline mok::gemm::WaitOptions gemm_test_waits() {
  return {gemm_test_timeout_ns(), &gemm_test_report()};
}

}  // namespace mok::test
