#include "cuda/comm/team.hpp"

#include <atomic>
#include <cstring>
#include <sstream>

#include "core/schedule_check.hpp"

namespace mok {

void cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  throw Error(std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
              ")");
}

namespace {

constexpr std::size_t kBadKeyOffset = offsetof(comm::DeviceErrorRecord, bad_slot_key);

// Zeroes a local region's sync state and error record (bad_slot_key = none).
void clear_record_and_sync(std::uint8_t* local, const plan::WorkspacePlan& plan, bool sync_too,
                           cudaStream_t stream) {
  std::uint8_t* rec = local + plan.error_record.offset;
  cuda_check(cudaMemsetAsync(rec, 0, sizeof(comm::DeviceErrorRecord), stream), "cudaMemsetAsync");
  cuda_check(cudaMemsetAsync(rec + kBadKeyOffset, 0xff, sizeof(std::uint64_t), stream),
             "cudaMemsetAsync");
  if (sync_too) {
    cuda_check(cudaMemsetAsync(local + plan.sync_state.offset, 0, sizeof(plan::SyncState), stream),
               "cudaMemsetAsync");
  }
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

std::unique_ptr<Team::Impl> make_impl(const Problem& p, const Config& c, const TeamOptions& o) {
  validate_schedule_problem(p, c);
  if (o.barrier_timeout_ms == 0) {
    throw Error("TeamOptions.barrier_timeout_ms", "a positive number of milliseconds", "0");
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    throw Error("the CUDA team needs a CUDA device; none is visible");
  }
  if (o.device_index < 0 || o.device_index >= count) {
    throw Error("TeamOptions.device_index", "in [0, " + std::to_string(count) + ")",
                to_text(o.device_index));
  }
  auto impl = std::make_unique<Team::Impl>();
  impl->problem = p;
  impl->config = c;
  impl->options = o;
  impl->device = o.device_index;
  impl->world_size = p.ep_size;
  impl->plan = plan::make_workspace_plan(plan_shape_of(p, c));
  cuda_check(cudaSetDevice(impl->device), "cudaSetDevice");
  cuda_check(cudaDeviceGetAttribute(&impl->sm_count, cudaDevAttrMultiProcessorCount, impl->device),
             "cudaDeviceGetAttribute");
  return impl;
}

// Lays regions out back to back with a guard zone before, between and after them.
std::vector<std::uint8_t*> carve_regions(Team::Impl& t, const std::vector<std::int64_t>& sizes) {
  using Impl = Team::Impl;
  std::int64_t total = Impl::kGuardBytes;
  for (std::int64_t s : sizes) total += s + Impl::kGuardBytes;
  cuda_check(cudaMalloc(&t.allocation, static_cast<std::size_t>(total)),
             "cudaMalloc(team workspace)");
  t.allocation_bytes = total;
  auto* base = static_cast<std::uint8_t*>(t.allocation);
  cuda_check(cudaMemset(base, Impl::kGuardByte, static_cast<std::size_t>(total)), "cudaMemset");
  std::vector<std::uint8_t*> regions;
  std::int64_t at = 0;
  t.guards.push_back({base, Impl::kGuardBytes});
  at += Impl::kGuardBytes;
  for (std::int64_t s : sizes) {
    regions.push_back(base + at);
    cuda_check(cudaMemset(base + at, 0, static_cast<std::size_t>(s)), "cudaMemset");
    at += s;
    t.guards.push_back({base + at, Impl::kGuardBytes});
    at += Impl::kGuardBytes;
  }
  return regions;
}

void allocate_mirrors(Team::Impl& t) {
  void* host = nullptr;
  const std::size_t bytes = sizeof(comm::DeviceErrorRecord) * t.num_local_ranks;
  cuda_check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc(error mirror)");
  std::memset(host, 0, bytes);
  t.mirrors = static_cast<comm::DeviceErrorRecord*>(host);
}

}  // namespace

Team::Impl::~Impl() {
  if (allocation) cudaFree(allocation);
  if (mirrors) cudaFreeHost(mirrors);
}

void Team::Impl::make_current() const {
  int current = -1;
  cuda_check(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
}

comm::TeamArgs Team::Impl::team_args() const {
  comm::TeamArgs a;
  a.world_size = world_size;
  a.first_rank = first_rank;
  a.timeout_ns = options.barrier_timeout_ms * 1000000ull;
  a.plan = plan;
  for (int r = 0; r < world_size; ++r) a.symmetric[r] = symmetric[r];
  for (int i = 0; i < num_local_ranks; ++i) {
    a.local[i] = local[i];
    // NOTES: with unified addressing the pinned host pointer is valid on the device as is.
    a.mirror[i] = mirrors + i;
  }
  return a;
}

std::string describe_device_error(const comm::DeviceErrorRecord& r, std::uint64_t timeout_ns) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(1);
  if (r.kind == static_cast<std::uint32_t>(comm::ErrorKind::barrier_timeout)) {
    s << "device wait timed out on rank " << r.rank << " (block " << r.block << "): ";
    if (r.flag == static_cast<std::uint32_t>(comm::FlagId::team_barrier)) {
      s << "team barrier flag[" << r.flag_index << "] (arrivals from rank " << r.flag_index << ")";
    } else if (r.flag == static_cast<std::uint32_t>(comm::FlagId::fused_ready)) {
      s << "forward megakernel counter ready[" << r.flag_index << "] (the pull of ring rows ["
        << 128ll * r.flag_index << ", " << 128ll * (r.flag_index + 1) << ") of the pass)";
    } else if (r.flag == static_cast<std::uint32_t>(comm::FlagId::fused_done)) {
      s << "forward megakernel counter done[" << r.flag_index
        << "] (the gate/up tiles of ring rows [" << 128ll * r.flag_index << ", "
        << 128ll * (r.flag_index + 1) << ") of the pass)";
    } else if (r.flag == static_cast<std::uint32_t>(comm::FlagId::fused_shared_done)) {
      s << "forward megakernel counter shared_done[" << r.flag_index
        << "] (the shared expert's gate/up tiles of tokens [" << 128ll * r.flag_index << ", "
        << 128ll * (r.flag_index + 1) << "))";
    } else {
      s << "grid barrier counter of rank " << r.rank << " (arrivals from its blocks)";
    }
    s << " expected >= " << r.expected << ", seen " << r.seen << " after "
      << static_cast<double>(r.waited_ns) * 1e-6 << " ms (timeout "
      << static_cast<double>(timeout_ns) * 1e-6 << " ms)";
    if (r.flag == static_cast<std::uint32_t>(comm::FlagId::team_barrier)) {
      s << "; rank " << r.flag_index << " did not arrive (is every rank of the team calling?)";
    }
  } else {
    s << bad_expert_id_argument(r.rank, r.token, r.slot) << " = " << r.value;
  }
  return s.str();
}

void Team::Impl::raise_device_errors(cudaStream_t stream) {
  if (broken) {
    throw Error(
        "the team's barrier counters are inconsistent after a device wait timed out; call "
        "Team::reset() on every rank before using it again");
  }
  const bool can_clear = !capturing(stream);
  if (pending_device_clear && can_clear) {
    for (int i = 0; i < num_local_ranks; ++i) clear_record_and_sync(local[i], plan, false, stream);
    pending_device_clear = false;
  }
  int first = -1, more = 0;
  comm::DeviceErrorRecord rec{};
  for (int i = 0; i < num_local_ranks; ++i) {
    volatile comm::DeviceErrorRecord* m = mirrors + i;
    if (m->kind == 0) continue;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (first < 0) {
      first = i;
      std::memcpy(&rec, const_cast<comm::DeviceErrorRecord*>(mirrors + i), sizeof(rec));
      rec.kind = m->kind;
    } else {
      ++more;
    }
  }
  if (first < 0) return;
  // Consume: clear every mirror now, the device records in stream order (or at the next call when
  // this stream is being captured).
  bool timeout = false;
  for (int i = 0; i < num_local_ranks; ++i) {
    volatile comm::DeviceErrorRecord* m = mirrors + i;
    // NOTES: a timeout of the forward megakernel's own counters leaves nothing inconsistent on a
    // virtual team (the launch resets them as it ends; no team barrier follows it in the call);
    // on a team across processes the call's next team barrier gave up with it.
    const bool own_counters =
        m->flag == static_cast<std::uint32_t>(comm::FlagId::fused_ready) ||
        m->flag == static_cast<std::uint32_t>(comm::FlagId::fused_done) ||
        m->flag == static_cast<std::uint32_t>(comm::FlagId::fused_shared_done);
    timeout = timeout ||
              (m->kind == static_cast<std::uint32_t>(comm::ErrorKind::barrier_timeout) &&
               !(own_counters && virtual_ranks));
    m->kind = 0;
  }
  if (can_clear) {
    for (int i = 0; i < num_local_ranks; ++i) clear_record_and_sync(local[i], plan, false, stream);
  } else {
    pending_device_clear = true;
  }
  if (timeout) broken = true;
  const std::string others =
      more ? " (" + std::to_string(more) + " more rank(s) of this process reported errors too)"
           : "";
  if (rec.kind == static_cast<std::uint32_t>(comm::ErrorKind::bad_expert_id)) {
    throw Error(
        bad_expert_id_argument(rec.rank, rec.token, rec.slot),
        expert_id_range_text(problem.num_experts),
        to_text(rec.value) + " (found on the device; the slot was treated as unused)" + others);
  }
  throw Error(describe_device_error(rec, options.barrier_timeout_ms * 1000000ull) + others);
}

void Team::Impl::reset_state() {
  make_current();
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (Team::reset)");
  for (int i = 0; i < num_local_ranks; ++i) {
    clear_record_and_sync(local[i], plan, true, nullptr);
    const int rank = first_rank + i;
    cuda_check(cudaMemset(symmetric[rank] + plan.team_flags.offset, 0,
                          static_cast<std::size_t>(plan.team_flags.bytes)),
               "cudaMemset(team flags)");
  }
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (Team::reset)");
  std::memset(static_cast<void*>(mirrors), 0, sizeof(comm::DeviceErrorRecord) * num_local_ranks);
  broken = false;
  pending_device_clear = false;
}

bool Team::Impl::guards_intact() const {
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::vector<unsigned char> host;
  for (const Guard& g : guards) {
    host.resize(static_cast<std::size_t>(g.bytes));
    cuda_check(cudaMemcpy(host.data(), g.ptr, host.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (unsigned char b : host) {
      if (b != kGuardByte) return false;
    }
  }
  return true;
}

// --- mok::Team --------------------------------------------------------------------------------

Team::Team(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Team::Team(Team&&) noexcept = default;
Team& Team::operator=(Team&&) noexcept = default;
Team::~Team() = default;

Team Team::local_virtual(const Problem& p, const Config& config, const TeamOptions& options) {
  auto impl = make_impl(p, config, options);
  impl->virtual_ranks = true;
  impl->first_rank = 0;
  impl->num_local_ranks = p.ep_size;
  std::vector<std::int64_t> sizes(2 * p.ep_size);
  for (int r = 0; r < p.ep_size; ++r) {
    sizes[r] = impl->plan.symmetric_bytes;
    sizes[p.ep_size + r] = impl->plan.local_bytes;
  }
  const std::vector<std::uint8_t*> regions = carve_regions(*impl, sizes);
  impl->symmetric.assign(regions.begin(), regions.begin() + p.ep_size);
  impl->local.assign(regions.begin() + p.ep_size, regions.end());
  allocate_mirrors(*impl);
  impl->reset_state();
  prepare_build_schedule(*impl);
  return Team(std::move(impl));
}

Team Team::external(const Problem& p, const Config& config, const ExternalTeamPointers& ptrs,
                    const TeamOptions& options) {
  auto impl = make_impl(p, config, options);
  if (ptrs.rank != p.ep_rank) {
    throw Error("ExternalTeamPointers.rank", "problem.ep_rank = " + to_text(p.ep_rank),
                to_text(ptrs.rank));
  }
  if (static_cast<int>(ptrs.symmetric_bases.size()) != p.ep_size) {
    throw Error("ExternalTeamPointers.symmetric_bases", to_text(p.ep_size) + " pointers (ep_size)",
                to_text(ptrs.symmetric_bases.size()));
  }
  for (int r = 0; r < p.ep_size; ++r) {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptrs.symmetric_bases[r]);
    if (addr == 0 || addr % plan::kBufferAlignment != 0) {
      throw Error("ExternalTeamPointers.symmetric_bases[" + std::to_string(r) + "]",
                  "a device pointer aligned to " + to_text(plan::kBufferAlignment) + " bytes",
                  addr == 0 ? std::string("null") : "address " + to_text(addr));
    }
  }
  impl->virtual_ranks = false;
  impl->first_rank = p.ep_rank;
  impl->num_local_ranks = 1;
  for (void* b : ptrs.symmetric_bases) impl->symmetric.push_back(static_cast<std::uint8_t*>(b));
  impl->local = carve_regions(*impl, {impl->plan.local_bytes});
  allocate_mirrors(*impl);
  impl->reset_state();
  prepare_build_schedule(*impl);
  return Team(std::move(impl));
}

const Problem& Team::problem() const {
  return impl_->problem;
}
const Config& Team::config() const {
  return impl_->config;
}
int Team::world_size() const {
  return impl_->world_size;
}
int Team::first_rank() const {
  return impl_->first_rank;
}
int Team::num_local_ranks() const {
  return impl_->num_local_ranks;
}
Team::Impl& Team::impl() {
  return *impl_;
}
const Team::Impl& Team::impl() const {
  return *impl_;
}

ScheduleViews Team::schedule(int rank) const {
  const Impl& t = *impl_;
  if (rank < t.first_rank || rank >= t.first_rank + t.num_local_ranks) {
    throw Error("rank",
                "one of this process's ranks [" + to_text(t.first_rank) + ", " +
                    to_text(t.first_rank + t.num_local_ranks) + ")",
                to_text(rank));
  }
  std::uint8_t* local = t.local[rank - t.first_rank];
  const Device dev{DeviceKind::cuda, t.device};
  const std::int64_t E_local = t.problem.num_local_experts();
  auto view = [&](const plan::Buffer& b, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(local + b.offset, DType::i32, shape, dev);
  };
  return {view(t.plan.schedule_table, {schedule_capacity_rows(t.problem)}),
          view(t.plan.expert_counts, {E_local}),
          view(t.plan.expert_src_counts, {E_local, std::int64_t{t.world_size}}),
          view(t.plan.segment_starts, {E_local + 1}), view(t.plan.ring_plan, {kRingPlanInts})};
}

void Team::check_errors(void* stream) {
  impl_->make_current();
  impl_->raise_device_errors(static_cast<cudaStream_t>(stream));
}

void Team::reset() {
  impl_->reset_state();
}

}  // namespace mok
