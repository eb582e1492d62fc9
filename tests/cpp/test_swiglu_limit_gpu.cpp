// Clamped SwiGLU (Weights::swiglu_limit) on the CUDA layer: forward and every gradient against the
// exact f64 layer at several limits, repeated bitwise; a limit no value reaches gives the
// unclamped layer's bits; several ring passes (backward replays the clamped forward) give the
// bits of one. Skipped without a GPU (passed on the H200 at 7db507e; half_narrow since 1a1eca3).
// The cases with I <= H (seven_no_shared, half_narrow) take the backward that writes bf16(w h) in
// the down dgrad's epilogue (plan::scaled_hidden_in_backward), the others the one that scales
// d_out.
#include <cstdio>

#include "gpu_buffer.hpp"
#include "layer_gpu_helpers.hpp"
#include "layer_helpers.hpp"
#include "synthetic/device_layer.hpp"

namespace mok::test {
namespace {

struct LimitCase {
  const char* name;
  float limit;
  Problem problem;
  Routing routing;
};
void PrintTo(const LimitCase& c, std::ostream* os) {
  *os << c.name;
}

class SwigluLimitGpu : public ::testing::TestWithParam<LimitCase> {};

TEST_P(SwigluLimitGpu, MatchesTheF64LayerAndRepeatsBitwise) {
  MOK_REQUIRE_HOPPER();
  const LimitCase& c = GetParam();
  const std::uint64_t seed = test_seed();
  LayerData d = grid_layer(c.problem, seed, c.routing);
  d.swiglu_limit = c.limit;
  run_gpu(d);
  const CheckReport r = check_against_f64(d);  // the f64 layer with the same limit
  EXPECT_TRUE(r.passed()) << r.summary();
  LayerData plain = d;
  plain.swiglu_limit.reset();
  EXPECT_FALSE(check_against_f64(plain).passed()) << "the limit changed nothing?";
  std::printf("[ mok ] %s: out %.2e, grads max %.2e\n", c.name, r.out_rel_err(),
              r.grad_rel_err_max());
  for (int run = 1; run < 5; ++run) {
    LayerData again = grid_layer(c.problem, seed, c.routing);
    again.swiglu_limit = c.limit;
    run_gpu(again);
    EXPECT_TRUE(all_outputs_same(d, again)) << "run " << run << " differs";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Limits, SwigluLimitGpu,
    ::testing::Values(
        LimitCase{"half_shared", 0.5f, layer_shape(257, 64, 192, 8, 2, 64), Routing::softmax},
        LimitCase{"one_skewed", 1.0f, layer_shape(131, 64, 128, 6, 3, 128), Routing::skewed},
        LimitCase{"seven_shared", 7.0f, layer_shape(97, 64, 128, 4, 4, 128), Routing::softmax},
        LimitCase{"seven_no_shared", 7.0f, layer_shape(64, 64, 64, 5, 2, 0), Routing::one_expert},
        // I < H: bf16(w h) from the clamped h of the dgrad epilogue (H = 128: grid_layer's x)
        LimitCase{"half_narrow", 0.5f, layer_shape(193, 128, 64, 6, 2, 0), Routing::skewed}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(SwigluLimitGpuBits, InactiveLimitIsTheUnclampedLayer) {
  MOK_REQUIRE_HOPPER();
  const Problem p = layer_shape(200, 128, 192, 8, 2, 64);
  const std::uint64_t seed = test_seed();
  LayerData plain = make_layer_data(p, DType::bf16, seed);
  run_gpu(plain);
  LayerData clamped = make_layer_data(p, DType::bf16, seed);
  clamped.swiglu_limit = 1.0e6f;
  run_gpu(clamped);
  EXPECT_TRUE(all_outputs_same(plain, clamped));
}

// Backward replays the forward of every pass but the first (the clamped gate/up epilogue) and
// recomputes h in the dgrad epilogue for the router-weight gradient: the bits of one pass.
TEST(SwigluLimitGpuBits, SeveralPassesGiveTheBitsOfOne) {
  MOK_REQUIRE_HOPPER();
  const Problem p = layer_shape(512, 64, 128, 4, 4, 64);
  const std::uint64_t seed = test_seed();
  LayerData one = grid_layer(p, seed, Routing::skewed);
  one.swiglu_limit = 1.0f;
  run_gpu(one);
  Config small;
  small.minibatch_size = 128;
  small.macrobatch_size = 512;  // 2048 routed rows: several passes
  LayerData many = grid_layer(p, seed, Routing::skewed);
  many.swiglu_limit = 1.0f;
  run_gpu(many, small);
  EXPECT_TRUE(all_outputs_same(one, many));
}

}  // namespace
}  // namespace mok::test
