// xgrammar's token bitmask as its matchers write it: a row of int32 words, token c allowed where bit c % 32 of
// word c / 32 is set. The masked ops read it where they use a column instead of having xgrammar write -inf into
// the logits first (apply_token_bitmask_inplace: a pass over every row and a Python op a step).
#pragma once

#include <cstdint>

inline const uint32_t* bitmask_row(const int32_t* words, int64_t row, int64_t width) {
  return reinterpret_cast<const uint32_t*>(words) + row * width;
}

inline bool token_allowed(const uint32_t* words, int64_t token) { return (words[token >> 5] >> (token & 31)) & 1u; }
