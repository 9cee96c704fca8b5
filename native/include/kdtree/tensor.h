// A view of a buffer as a typed tensor: what every op receives. Shapes are row-major; `bytes` is
// what the underlying buffer holds from `data` on (checked against product(shape) x dtype size).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kdtree {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3, kU8 = 4, kF64 = 5 };

inline int DTypeSize(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kU8: return 1;
    case DType::kF64: return 8;
  }
  return 0;
}

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "i32";
    case DType::kU8: return "u8";
    case DType::kF64: return "f64";
  }
  return "?";
}

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  int64_t bytes = 0;      // bytes available in the buffer from `data` on
  std::string name;       // the argument name, for messages

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  bool present() const { return data != nullptr; }  // optional arguments: absent when no buffer
  int64_t dim(int i) const { return shape[static_cast<size_t>(i)]; }
  int rank() const { return static_cast<int>(shape.size()); }
  template <typename T> T* as() const { return static_cast<T*>(data); }
  std::string Describe() const;  // "x: bf16 [3, 7168]"
};

}  // namespace kdtree
