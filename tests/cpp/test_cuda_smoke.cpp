// The GPU smoke test: a device query and one launch. Skipped (visibly) without a Hopper GPU, and
// in builds without the CUDA backend.
#include <gtest/gtest.h>

#include "core/backend.hpp"
#if defined(MOK_HAVE_CUDA)
#include "gpu_buffer.hpp"
#endif

TEST(CudaSmoke, DeviceQueryAndOneLaunch) {
#if defined(MOK_HAVE_CUDA)
  MOK_REQUIRE_HOPPER();
#else
  GTEST_SKIP() << "this build has no CUDA backend (MOK_CUDA=OFF)";
#endif
  ASSERT_TRUE(mok::cuda::compiled());
  std::printf("[ mok ] device 0: %s\n", mok::cuda::device_summary(0).c_str());
  EXPECT_EQ(mok::cuda::smoke_test(0), "");
}
