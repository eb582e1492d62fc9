// build_schedule on the GPU: one cooperative launch builds the schedule of every rank this process
// runs (gridDim.y = ranks, gridDim.x = blocks per rank), with no host synchronization.
//
//   stage ids -> team barrier -> count tiles -> grid barrier -> scan experts -> grid barrier
//   -> segment starts, place rows (and invert them), fill padding
//
// The steps are in schedule_blocks.cuh; the team (barriers, error record) in comm/team.cuh.
#include <algorithm>

#include "core/schedule_check.hpp"
#include "cuda/comm/team.hpp"
#include "cuda/kernels/schedule_blocks.cuh"

namespace mok {
namespace {

using namespace kernels::schedule_blocks;

// NOTES: two blocks per SM (64 registers) so that 8 virtual ranks get 33 blocks each.
constexpr int kMinBlocksPerSm = 2;

struct ScheduleKernelArgs {
  comm::TeamArgs team;
  const std::int64_t* ids[schedule::kMaxRanks];  // by blockIdx.y
  std::int64_t num_tokens, topk, num_experts;
  std::int64_t macrobatch_size, minibatch_size;
};

template <ptx::Scope Scope>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    build_schedule_kernel(const __grid_constant__ ScheduleKernelArgs args) {
  extern __shared__ std::int32_t smem[];
  comm::RankTeam<Scope> team(args.team);
  const plan::WorkspacePlan& plan = args.team.plan;
  const schedule::Shape shape{args.num_tokens, args.topk, args.num_experts, args.team.world_size};

  RankSchedule s;
  s.slots = shape.slots_per_rank();
  s.topk = args.topk;
  s.num_experts = args.num_experts;
  s.tiles_per_rank = shape.tiles_per_rank();
  s.num_tiles = s.tiles_per_rank * shape.ep_size;
  s.max_rows = schedule::max_schedule_rows(shape);
  s.num_local_experts = static_cast<std::int32_t>(shape.num_local_experts());
  s.rank = team.rank();
  s.world_size = shape.ep_size;
  s.ids = args.ids[blockIdx.y];
  // NOTES: the exchange is double-buffered by launch parity: a peer still reading our ids of the
  // previous launch never sees them overwritten (it must pass this launch's barrier first).
  const std::int64_t parity_offset = (team.launch_count() & 1u) * s.slots;
  s.staged = team.template symmetric<std::int32_t>(s.rank, plan.expert_ids) + parity_offset;
  s.table = team.template local<std::int32_t>(plan.schedule_table);
  s.counts = team.template local<std::int32_t>(plan.expert_counts);
  s.src_counts = team.template local<std::int32_t>(plan.expert_src_counts);
  s.segment_starts = team.template local<std::int32_t>(plan.segment_starts);
  s.ring_plan = team.template local<schedule::RingPlan>(plan.ring_plan);
  s.scratch = team.template local<std::int32_t>(plan.schedule_scratch);
  s.row_of_slot = team.template local<std::int32_t>(plan.row_of_slot);
  auto source_ids = [&](int src) -> const std::int32_t* {
    return team.template symmetric<std::int32_t>(src, plan.expert_ids) + parity_offset;
  };

  const int E = s.num_local_experts;
  std::int32_t* warp_counters = smem + warp_id() * E;
  std::int32_t* starts = smem + kWarps * E;
  std::int32_t* counts = starts + (E + 1);
  std::int32_t* warp_sums = counts + (E + 1);

  stage_expert_ids(s, team);
  if (!team.team_barrier()) return;  // every rank's ids are staged
  if (blockIdx.x == 0 && threadIdx.x == 0) team.publish_bad_slot(s.ids, s.topk);
  count_tiles(s, source_ids, warp_counters);
  if (!team.grid_barrier()) return;
  scan_experts(s);
  if (!team.grid_barrier()) return;
  team.finish(/*count_launch=*/true);
  compute_segments(s, args.macrobatch_size, args.minibatch_size, starts, counts, warp_sums);
  place_tiles(s, source_ids, starts, warp_counters);
  fill_padding(s, starts, counts);
}

// Blocks per rank: enough warps for the tiles and the experts, all ranks resident at once.
// NOTES: every rank of a team must use the same count (the team barrier expects gridDim.x arrivals
// from each peer), so ranks in other processes use a count that depends on the shape alone.
int choose_blocks_per_rank(const Team::Impl& t, const void* kernel, std::int64_t smem) {
  constexpr std::int64_t kMaxBlocksPerRank = 128;
  int per_sm = 0;
  cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                           static_cast<std::size_t>(smem)),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const std::int64_t resident = std::int64_t{per_sm} * t.sm_count;
  const int ranks = t.num_local_ranks;
  const schedule::Shape shape{t.problem.num_tokens, t.problem.topk, t.problem.num_experts,
                              t.problem.ep_size};
  const std::int64_t work =
      std::max(shape.tiles_per_rank() * shape.ep_size, shape.num_local_experts());
  const std::int64_t wanted =
      std::clamp<std::int64_t>((work + kWarps - 1) / kWarps, 1, kMaxBlocksPerRank);
  const std::int64_t blocks = t.virtual_ranks ? std::min(wanted, resident / ranks) : wanted;
  if (blocks < 1 || blocks * ranks > resident) {
    throw Error("build_schedule needs " +
                std::to_string(std::max<std::int64_t>(blocks, 1) * ranks) + " resident blocks of " +
                std::to_string(kThreads) + " threads for " + std::to_string(ranks) +
                " rank(s); this GPU holds " + std::to_string(resident));
  }
  return static_cast<int>(blocks);
}

template <ptx::Scope Scope>
void prepare(Team::Impl& t) {
  const void* kernel = reinterpret_cast<const void*>(&build_schedule_kernel<Scope>);
  const std::int64_t smem = shared_bytes(t.problem.num_local_experts());
  int max_optin = 0;
  cuda_check(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, t.device),
             "cudaDeviceGetAttribute");
  if (smem > max_optin) {
    throw Error("num_experts / ep_size",
                "at most " + to_text((max_optin / 4 - 2 * kWarps - 2) / (kWarps + 2)) +
                    " local experts (build_schedule's shared memory)",
                to_text(t.problem.num_local_experts()));
  }
  // NOTES: the limit belongs to the kernel on this device, which every team shares: only ever
  // raise it, so a team with fewer experts created later never lowers it under an earlier team's
  // launches (seen: cudaErrorInvalidValue from the first team's next build_schedule).
  cudaFuncAttributes attributes{};
  cuda_check(cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes");
  if (attributes.maxDynamicSharedSizeBytes < smem) {
    cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)),
               "cudaFuncSetAttribute");
  }
  t.schedule_blocks_per_rank = choose_blocks_per_rank(t, kernel, smem);
}

template <ptx::Scope Scope>
void launch(const Team::Impl& t, const ScheduleKernelArgs& args, cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(t.schedule_blocks_per_rank, t.num_local_ranks, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = static_cast<std::size_t>(shared_bytes(t.problem.num_local_experts()));
  config.stream = stream;
  // NOTES: cooperative: the launch fails rather than run with some blocks not resident (every
  // barrier waits for all blocks). It is valid in stream capture (a cooperative graph node).
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  cuda_check(cudaLaunchKernelEx(&config, build_schedule_kernel<Scope>, args),
             "launch of build_schedule");
}

}  // namespace

void prepare_build_schedule(Team::Impl& t) {
  // NOTES: at team creation, so that no build_schedule call (a captured one included) queries or
  // configures anything.
  if (t.virtual_ranks) {
    prepare<ptx::Scope::gpu>(t);
  } else {
    prepare<ptx::Scope::sys>(t);
  }
}

void build_schedule(Team& team, std::span<const TensorView> topk_experts,
                    const ScheduleOptions& options) {
  Team::Impl& t = team.impl();
  auto stream = static_cast<cudaStream_t>(options.stream);
  t.make_current();
  t.raise_device_errors(stream);  // an error of an earlier call surfaces here at the latest
  const Problem& p = t.problem;
  check_topk_experts_list(
      p, topk_experts, static_cast<std::size_t>(t.num_local_ranks),
      Device{DeviceKind::cuda, t.device},
      t.virtual_ranks ? "one per virtual rank of the team" : "this rank's only");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (options.synchronous_validation && capture != cudaStreamCaptureStatusNone) {
    throw Error("ScheduleOptions.synchronous_validation",
                "false while the stream is being captured (it waits for the device)", "true");
  }

  ScheduleKernelArgs args{};
  args.team = t.team_args();
  for (int i = 0; i < t.num_local_ranks; ++i) {
    args.ids[i] = topk_experts[i].ptr<const std::int64_t>();
  }
  args.num_tokens = p.num_tokens;
  args.topk = p.topk;
  args.num_experts = p.num_experts;
  args.macrobatch_size = schedule::macrobatch_rows({p.num_tokens, p.topk, p.num_experts, p.ep_size},
                                                  t.config.macrobatch_size, t.config.minibatch_size);
  args.minibatch_size = t.config.minibatch_size;
  if (t.virtual_ranks) {
    launch<ptx::Scope::gpu>(t, args, stream);
  } else {
    launch<ptx::Scope::sys>(t, args, stream);
  }
  if (options.synchronous_validation) {
    cuda_check(cudaStreamSynchronize(stream), "build_schedule (synchronous validation)");
    t.raise_device_errors(stream);
  }
}

}  // namespace mok
