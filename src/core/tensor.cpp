#include "mok/tensor.hpp"

#include <sstream>

#include "mok/error.hpp"

namespace mok {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::bf16:
      return "bfloat16";
    case DType::f32:
      return "float32";
    case DType::f64:
      return "float64";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::fp8_e4m3:
      return "fp8_e4m3";
    case DType::u8:
      return "uint8";
  }
  return "unknown";
}

std::string device_name(Device d) {
  return d.kind == DeviceKind::cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

TensorView TensorView::contiguous(void* data, DType dtype,
                                  std::initializer_list<std::int64_t> shape, Device device) {
  TensorView v;
  if (shape.size() > kMaxDims) {
    throw Error("tensor rank", "at most " + std::to_string(kMaxDims), to_text(shape.size()));
  }
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  v.device = device;
  int i = 0;
  for (std::int64_t s : shape) v.shape[i++] = s;
  std::int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

static std::string list_text(const std::array<std::int64_t, TensorView::kMaxDims>& v, int n) {
  std::ostringstream s;
  s << '[';
  for (int d = 0; d < n; ++d) s << (d ? ", " : "") << v[d];
  s << ']';
  return s.str();
}

std::string TensorView::shape_text() const {
  return list_text(shape, ndim);
}
std::string TensorView::strides_text() const {
  return list_text(strides, ndim);
}

}  // namespace mok
