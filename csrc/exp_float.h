// exp(x) in float, shared by the C++ CPU ops (layer_ops.cpp's SiLU, attention_body.h's softmax), so
// both compute the same function. Included at file scope, before the per-instruction-set namespaces:
// it is inlined into each and compiled for that namespace's target.
#pragma once

#include <cstdint>
#include <cstring>

// exp(x) in float for x in [-87, 88]: Cody-Waite reduction by ln 2 and a degree-7 Taylor polynomial
// (truncation ~5e-9 relative, below float's 6e-8); branch-free so loops over it vectorise. Outside that range the
// result is meaningless but computed without undefined behaviour (the softmax runs it over masked keys' scores and
// discards those).
static inline __attribute__((always_inline)) float exp_float_in_range(float x) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  const float t = x * 1.44269504f + magic;
  const float n = t - magic;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // The exponent's bits in unsigned arithmetic: the same bits as signed on [-87, 88], and defined (wrapping) for any
  // input, which a vectorised loop may compute for lanes whose results it then discards.
  uint32_t tb, mb;
  std::memcpy(&tb, &t, sizeof tb);
  std::memcpy(&mb, &magic, sizeof mb);
  const uint32_t bits = (tb - mb + 127u) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp(x) in float, x first clamped to [-87, 88] (as comparisons: std::fmin / fmax have NaN rules that keep GCC from
// vectorising them); on that range the same bits as exp_float_in_range.
static inline __attribute__((always_inline)) float exp_float(float x) {
  x = x > 88.0f ? 88.0f : x;
  x = x < -87.0f ? -87.0f : x;
  return exp_float_in_range(x);
}

// The sum of exp(v[i] - shift) over n floats (shift a row's maximum), with kStore also each term into e[i]:
// 16 float lanes, each flushed into a double total every 64 of its terms (a sequential float sum over tens of
// thousands of terms drifts by ~1e-4; the lanes let GCC vectorise the exponential). The additions' order is
// fixed by the lanes, not by the instruction set. Inlined into each caller's per-instruction-set clones.
template <bool kStore>
static inline __attribute__((always_inline)) double sum_exp_lanes(const float* __restrict v, float* __restrict e,
                                                                  int64_t n, float shift) {
  constexpr int64_t kLanes = 16, kFlush = 64;
  double total = 0.0;
  int64_t i = 0;
  for (; i + kLanes * kFlush <= n; i += kLanes * kFlush) {
    float lane[kLanes] = {};
    for (int64_t j = 0; j < kFlush; ++j)
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t c = i + j * kLanes + l;
        const float x = exp_float(v[c] - shift);
        if constexpr (kStore) e[c] = x;
        lane[l] += x;
      }
    for (int64_t l = 0; l < kLanes; ++l) total += lane[l];
  }
  for (; i < n; ++i) {
    const float x = exp_float(v[i] - shift);
    if constexpr (kStore) e[i] = x;
    total += x;
  }
  return total;
}
