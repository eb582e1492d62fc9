// The SM clock while a benchmark's timings run, read from the driver's NVML on a background
// thread (the C++ twin of bench/gpu_clocks.py, without its power reading: NVML's board power is a
// trailing average over about a second on Hopper, so an item timed for a fraction of a second
// between others would report partly their power). At the power limit a kernel's time is
// its energy, so a form that is slower than another at the same clock is slower per clock (its
// loop), and one that is slower at a lower clock spends more energy per FLOP (its data movement):
// the two call for different changes (docs/perf/NOTES.md).
//
//   ClockSampler clocks(device);          // starts sampling every 5 ms
//   const double t0 = clocks.now(); ...timed work...; windows.push_back({t0, clocks.now()});
//   clocks.over(windows)                  // median SM clock inside the windows
//
// Reads only; never changes a setting. NVML is loaded with dlopen, so nothing is
// linked against it; where it cannot be loaded (no driver library) `over` returns nothing and the
// benchmark runs as before.
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

class ClockSampler {
 public:
  struct Summary {
    double sm_mhz_median = 0;
    int samples = 0;
  };
  using Window = std::pair<double, double>;  // [start, end) in seconds of now()

  explicit ClockSampler(int cuda_device) : start_(std::chrono::steady_clock::now()) {
    if (!load(cuda_device)) return;
    thread_ = std::thread([this] { run(); });
  }
  ~ClockSampler() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    // NVML is left initialised and loaded: the process ends soon after, and nvmlShutdown would
    // race no one but costs a driver call for nothing.
  }
  ClockSampler(const ClockSampler&) = delete;
  ClockSampler& operator=(const ClockSampler&) = delete;

  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

  // The samples taken inside any of the windows; nothing where NVML is absent or no sample fell
  // inside (a window shorter than the 5 ms period).
  std::optional<Summary> over(const std::vector<Window>& windows) const {
    std::vector<double> mhz;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Sample& s : samples_) {
        const bool inside = std::any_of(windows.begin(), windows.end(), [&](const Window& w) {
          return s.t >= w.first && s.t < w.second;
        });
        if (inside) mhz.push_back(s.mhz);
      }
    }
    if (mhz.empty()) return std::nullopt;
    Summary r;
    r.samples = static_cast<int>(mhz.size());
    std::nth_element(mhz.begin(), mhz.begin() + mhz.size() / 2, mhz.end());
    r.sm_mhz_median = mhz[mhz.size() / 2];
    return r;
  }

 private:
  struct Sample {
    double t, mhz;
  };
  using Device = void*;  // nvmlDevice_t
  using InitFn = int (*)();
  using HandleByBusFn = int (*)(const char*, Device*);
  using ClockFn = int (*)(Device, int, unsigned*);
  static constexpr int kClockSm = 1;  // NVML_CLOCK_SM

  bool load(int cuda_device) {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return false;
    const auto init = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
    const auto by_bus =
        reinterpret_cast<HandleByBusFn>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    clock_ = reinterpret_cast<ClockFn>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    if (init == nullptr || by_bus == nullptr || clock_ == nullptr) return false;
    // The CUDA device's NVML handle by its PCI bus id: CUDA's and NVML's device orders can differ.
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), cuda_device) != cudaSuccess) return false;
    return init() == 0 && by_bus(bus, &device_) == 0;
  }

  void run() {
    while (!stop_) {
      unsigned mhz = 0;
      if (clock_(device_, kClockSm, &mhz) == 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        samples_.push_back({now(), double(mhz)});
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  const std::chrono::steady_clock::time_point start_;
  Device device_ = nullptr;
  ClockFn clock_ = nullptr;
  std::atomic<bool> stop_{false};
  mutable std::mutex mutex_;
  std::vector<Sample> samples_;
  std::thread thread_;
};
