// The native kernels' one ceiling division (inference/arith.py's cdiv for the Python side).
#pragma once

#include <cstdint>

namespace kvs {

// a / b rounded up, for a >= 0 and b > 0
constexpr int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace kvs
