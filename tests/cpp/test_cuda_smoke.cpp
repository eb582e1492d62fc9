// The GPU smoke test: a device query and one launch. Skipped (visibly) without a GPU.
#include <gtest/gtest.h>

#include "core/backend.hpp"

TEST(CudaSmoke, DeviceQueryAndOneLaunch) {
  if (!mok::cuda::compiled()) GTEST_SKIP() << "this build has no CUDA support";
  if (mok::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  std::printf("[ mok ] device 0: %s\n", mok::cuda::device_summary(0).c_str());
  EXPECT_EQ(mok::cuda::smoke_test(0), "");
}
