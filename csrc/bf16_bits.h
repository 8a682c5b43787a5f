// A bf16 value widened to float by its bits (a bf16 is the high half of its float): branch-free, so loops
// over it vectorise where loops over c10::BFloat16's conversion do not.
#pragma once

#include <cstdint>
#include <cstring>

inline __attribute__((always_inline)) float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
