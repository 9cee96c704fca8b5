// Status codes returned by every kernel entry point. The Node binding turns a failed Status into a
// JS Error carrying the message, which names the op, the tensors and every shape involved.
#pragma once
#include <sstream>
#include <string>
#include <utility>

namespace kdtree {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad shape, dtype, size or value: the caller's fault
  kUnsupported = 2,      // valid, but not implemented for this dtype/size
  kDeviceError = 3,      // the CUDA runtime failed (launch, allocation, driver)
  kOutOfMemory = 4,
};

struct Status {
  Code code = Code::kOk;
  std::string message;

  static Status Ok() { return {}; }
  bool ok() const { return code == Code::kOk; }
};

// Builds a message from streamable parts: Invalid("w4a16_gemm: x is [", m, ", ", k, "]").
template <typename... Parts>
Status MakeStatus(Code code, Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return {code, os.str()};
}
template <typename... Parts>
Status Invalid(Parts&&... parts) {
  return MakeStatus(Code::kInvalidArgument, std::forward<Parts>(parts)...);
}
template <typename... Parts>
Status Unsupported(Parts&&... parts) {
  return MakeStatus(Code::kUnsupported, std::forward<Parts>(parts)...);
}

#define KDTREE_RETURN_IF_ERROR(expr)      \
  do {                                    \
    ::kdtree::Status _s = (expr);         \
    if (!_s.ok()) return _s;              \
  } while (0)

}  // namespace kdtree
