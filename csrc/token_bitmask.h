// xgrammar's token bitmask as its matchers write it: a row of int32 words, token c allowed where bit c % 32 of
// word c / 32 is set. The masked ops read it where they use a column instead of having xgrammar write -inf into
// the logits first (apply_token_bitmask_inplace: a pass over every row and a Python op a step).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
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

// The rows of a grammar-masked LM head call (bitmask [rows, width] words, flags[r]: row r is masked) by what
// they need: a masked row whose mask allows at most `max_allowed` tokens is sparse and needs only its allowed
// columns below `covered` (= min(N, 32 * width)) and every column from there to N (a mask leaves those as they
// are); its other columns are -inf. Every other row is dense: all N columns.
struct MaskedRows {
  std::vector<int64_t> dense, sparse;
  std::vector<int64_t> cols, cols_at{0};  // sparse row i's columns, in order: cols[cols_at[i] .. cols_at[i + 1])
};

inline MaskedRows split_masked_rows(const uint32_t* bits, int64_t width, const bool* flags, int64_t rows, int64_t N,
                                    int64_t max_allowed) {
  MaskedRows out;
  const int64_t covered = N < 32 * width ? N : 32 * width;
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* words = bits + r * width;
    if (!flags[r] || count_allowed(words, width) > max_allowed) {
      out.dense.push_back(r);
      continue;
    }
    out.sparse.push_back(r);
    for (int64_t w = 0; w * 32 < covered; ++w)
      for (uint32_t b = words[w]; b != 0; b &= b - 1) {
        const int64_t c = w * 32 + __builtin_ctz(b);
        if (c >= covered) break;
        out.cols.push_back(c);
      }
    for (int64_t c = covered; c < N; ++c) out.cols.push_back(c);
    out.cols_at.push_back(static_cast<int64_t>(out.cols.size()));
  }
  return out;
}

// A masked LM head's mask arguments for x of `rows` rows: bitmask [rows, W] int32 and masked [rows] bool, both
// contiguous on the CPU.
inline void check_head_mask(const torch::Tensor& bitmask, const torch::Tensor& masked, int64_t rows, const char* op) {
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous() &&
                  bitmask.device().is_cpu() && bitmask.size(0) == rows,
              op, ": bitmask must be a contiguous CPU int32 [rows, W] tensor");
  TORCH_CHECK(masked.dim() == 1 && masked.scalar_type() == torch::kBool && masked.is_contiguous() &&
                  masked.device().is_cpu() && masked.size(0) == rows,
              op, ": masked must be a contiguous CPU bool [rows] tensor");
}

// A masked head's dense rows (``split_masked_rows``) through its plain kernel: rows `dense` of x ([*, K] of In)
// gathered, `compute(xs, n, ys)` ([n, K] -> [n, N] of Out), each output widened by `to_float` into its row of y
// ([*, N] float). A row's result does not depend on which rows share the kernel's call.
template <class In, class Out, class Compute, class ToFloat>
inline void dense_rows_through(const std::vector<int64_t>& dense, const In* x, int64_t K, int64_t N, float* y,
                               Compute compute, ToFloat to_float) {
  if (dense.empty()) return;
  const int64_t n = static_cast<int64_t>(dense.size());
  std::vector<In> xs(n * K);
  std::vector<Out> ys(n * N);
  for (int64_t i = 0; i < n; ++i) std::memcpy(xs.data() + i * K, x + dense[i] * K, K * sizeof(In));
  compute(xs.data(), n, ys.data());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < N; ++c) y[dense[i] * N + c] = to_float(ys[i * N + c]);
}

// The 16-column groups of a masked head's sparse rows (``split_masked_rows``), each once a row (a row's columns come
// in order, so their groups do): row i's are list[at[i] .. at[i + 1]). Work items of at most `item` of a row's groups:
// item e is row item_row[e]'s groups from list index item_start[e].
struct ListedGroups {
  std::vector<int64_t> list, at{0}, item_row, item_start;
};

inline ListedGroups listed_groups_of(const MaskedRows& split, int64_t cols_per_group, int64_t item) {
  ListedGroups out;
  for (size_t i = 0; i < split.sparse.size(); ++i) {
    for (int64_t k = split.cols_at[i]; k < split.cols_at[i + 1]; ++k)
      if (static_cast<int64_t>(out.list.size()) == out.at.back() || out.list.back() != split.cols[k] / cols_per_group)
        out.list.push_back(split.cols[k] / cols_per_group);
    out.at.push_back(static_cast<int64_t>(out.list.size()));
    for (int64_t g = out.at[i]; g < out.at[i + 1]; g += item) {
      out.item_row.push_back(static_cast<int64_t>(i));
      out.item_start.push_back(g);
    }
  }
  return out;
}

// Each sparse row of y ([*, N] float): -inf, then each of its columns c value(g, c), g the place in groups.list of the
// group that holds c.
template <class Value>
inline void fill_sparse_rows(const MaskedRows& split, const ListedGroups& groups, int64_t cols_per_group, float* y,
                             int64_t N, Value value) {
  for (size_t i = 0; i < split.sparse.size(); ++i) {
    float* row = y + split.sparse[i] * N;
    std::fill(row, row + N, -std::numeric_limits<float>::infinity());
    int64_t g = groups.at[i];
    for (int64_t k = split.cols_at[i]; k < split.cols_at[i + 1]; ++k) {
      const int64_t c = split.cols[k];
      while (groups.list[g] != c / cols_per_group) ++g;
      row[c] = value(g, c);
    }
  }
}
