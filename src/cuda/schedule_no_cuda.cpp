// The CUDA half of the schedule API in a build without CUDA: every entry point says so.
#include "mok/schedule.hpp"

namespace mok {

struct Team::Impl {};

namespace {
[[noreturn]] void no_cuda() {
  throw Error(
      "the CUDA team and build_schedule on the GPU are not available: this build of mok "
      "has no CUDA support (use build_schedule_cpu)");
}
}  // namespace

Team::Team(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Team::Team(Team&&) noexcept = default;
Team& Team::operator=(Team&&) noexcept = default;
Team::~Team() = default;
Team Team::local_virtual(const Problem&, const Config&, const TeamOptions&) {
  no_cuda();
}
Team Team::external(const Problem&, const Config&, const ExternalTeamPointers&,
                    const TeamOptions&) {
  no_cuda();
}
const Problem& Team::problem() const {
  no_cuda();
}
const Config& Team::config() const {
  no_cuda();
}
int Team::world_size() const {
  no_cuda();
}
int Team::first_rank() const {
  no_cuda();
}
int Team::num_local_ranks() const {
  no_cuda();
}
ScheduleViews Team::schedule(int) const {
  no_cuda();
}
void Team::check_errors(void*) {
  no_cuda();
}
void Team::reset() {
  no_cuda();
}
Team::Impl& Team::impl() {
  return *impl_;
}
const Team::Impl& Team::impl() const {
  return *impl_;
}

void build_schedule(Team&, std::span<const TensorView>, const ScheduleOptions&) {
  no_cuda();
}

}  // namespace mok
