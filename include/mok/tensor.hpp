// Tensor views: a pointer plus dtype, shape, strides (in elements) and device. mok never owns the
// memory behind a view; the caller (C++ code, or the Python binding via DLPack-style fields) does.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace mok {

// fp8_e4m3: e4m3 values stored as bytes (mok's FP8, core/fp8.hpp); u8: raw bytes (MoK's E8M0
// scale tensors). Both appear only in the FP8 calls (mok/fp8.hpp); the layer refuses them.
enum class DType : std::uint8_t { bf16, f32, f64, i32, i64, fp8_e4m3, u8 };
enum class DeviceKind : std::uint8_t { cpu, cuda };

constexpr std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::bf16:
      return 2;
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::fp8_e4m3:
    case DType::u8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType d);

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  bool operator==(const Device&) const = default;
};

std::string device_name(Device d);

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;  // 0 with data == nullptr: "absent" (e.g. no shared expert)
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> strides{};
  Device device{};

  // A row-major contiguous view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = {});

  bool defined() const { return data != nullptr || ndim > 0; }
  std::int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_text() const;    // "[4, 8]"
  std::string strides_text() const;  // "[8, 1]"

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

}  // namespace mok
