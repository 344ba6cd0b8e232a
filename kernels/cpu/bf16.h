// bf16 <-> float for the native kernels (included by kernels/cpu/*.cpp; kernels/native.py keys
// each library's build on the headers here too).
#pragma once

#include <cstdint>
#include <cstring>

namespace genrec_bf16 {

inline float to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t from_float(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

}  // namespace genrec_bf16
