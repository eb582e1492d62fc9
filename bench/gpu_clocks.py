"""What the GPU's clock and power did while a measurement ran: NVML read from a background thread.

    with ClockSampler() as s:
        t = median_ms(fn)
    s.summary()  # {"sm_mhz_median": ..., "sm_mhz_min": ..., "power_w_mean": ..., "reasons": [...]}

Reads only (clock, power, the driver's clock-event reasons); never changes a setting. NVML is the
driver's libnvidia-ml.so.1 through ctypes, so nothing needs installing; where it cannot be loaded
the summary is None and the benchmark runs as before.
"""
import ctypes
import statistics
import threading
import time

# nvmlDeviceGetCurrentClocksEventReasons bits (nvml.h) that say why the clock is below its maximum.
_REASONS = {
    0x1: "idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}
_NVML_CLOCK_SM = 1


class _Nvml:
    def __init__(self, index):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self.handle)) != 0:
            raise OSError(f"no NVML device {index}")

    def read(self):
        clock, power, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        ok = self.lib.nvmlDeviceGetClockInfo(self.handle, _NVML_CLOCK_SM, ctypes.byref(clock)) == 0
        ok = ok and self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(power)) == 0
        if self.lib.nvmlDeviceGetCurrentClocksEventReasons(self.handle, ctypes.byref(reasons)) != 0:
            reasons.value = 0
        return (clock.value, power.value / 1000.0, reasons.value) if ok else None


def _device_index():
    try:
        import torch
        return torch.cuda.current_device()
    except Exception:  # noqa: BLE001 - no torch or no GPU: NVML's first device
        return 0


class ClockSampler:
    """Samples every `period_s` between __enter__ and __exit__."""

    def __init__(self, period_s=0.01, index=None):
        self.period_s = period_s
        self.samples = []
        try:
            self.nvml = _Nvml(_device_index() if index is None else index)
        except (OSError, AttributeError):
            self.nvml = None
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        while not self._stop.is_set():
            s = self.nvml.read()
            if s is not None:
                self.samples.append(s)
            time.sleep(self.period_s)

    def __enter__(self):
        if self.nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        return False

    def summary(self):
        if not self.samples:
            return None
        clocks = [c for c, _, _ in self.samples]
        bits = 0
        for _, _, r in self.samples:
            bits |= r
        return {"sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
                "power_w_mean": round(statistics.fmean(p for _, p, _ in self.samples), 1),
                "samples": len(self.samples),
                "reasons": [name for bit, name in _REASONS.items() if bits & bit]}
