// xgrammar's token bitmask as its matchers write it: a row of int32 words, token c allowed where bit c % 32 of
// word c / 32 is set. The masked ops read it where they use a column instead of having xgrammar write -inf into
// the logits first (apply_token_bitmask_inplace: a pass over every row and a Python op a step).
#pragma once

#include <cstdint>
#include <vector>

inline const uint32_t* bitmask_row(const int32_t* words, int64_t row, int64_t width) {
  return reinterpret_cast<const uint32_t*>(words) + row * width;
}

inline bool token_allowed(const uint32_t* words, int64_t token) { return (words[token >> 5] >> (token & 31)) & 1u; }

// How many tokens a row of `width` words allows.
inline int64_t count_allowed(const uint32_t* words, int64_t width) {
  int64_t n = 0;
  for (int64_t w = 0; w < width; ++w) n += __builtin_popcount(words[w]);
  return n;
}

// The tokens below `covered` that a row allows, in increasing order, appended to `out`.
inline void append_allowed(const uint32_t* words, int64_t covered, std::vector<int64_t>& out) {
  for (int64_t w = 0; w * 32 < covered; ++w)
    for (uint32_t b = words[w]; b != 0; b &= b - 1) {
      const int64_t c = w * 32 + __builtin_ctz(b);
      if (c >= covered) break;
      out.push_back(c);
    }
}
