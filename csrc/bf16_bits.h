// bf16 <-> float by bits (a bf16 is the high half of its float): branch-free, so loops over them vectorise
// where loops over c10::BFloat16's conversions do not.
#pragma once

#include <cstdint>
#include <cstring>

inline __attribute__((always_inline)) float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// f rounded to bf16, as float bits (the bf16 in the high half, zeros below), as c10::BFloat16 converts (round
// to nearest even, NaN -> 0x7FC0); `>> 16` gives the bf16's own bits.
inline __attribute__((always_inline)) uint32_t bf16_rounded_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  // A signed comparison (both sides are below 2^31): SSE2 and AVX2 have no unsigned one.
  const uint32_t nan = 0u - static_cast<uint32_t>(static_cast<int32_t>(bits & 0x7FFFFFFFu) > 0x7F800000);
  return (rounded & ~nan) | (0x7FC00000u & nan);
}
