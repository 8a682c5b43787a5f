// sample_rows_lists: the next token of each row of a plain decode step's logits, drawn from softmax(logits / T)
// under top-k, top-p and min-p by the row's own uniform number (the inverse-CDF draw over the kept tokens in
// token-id order that kernels/sampling.py's reference makes), or the argmax where T <= 0. The torch form
// runs a dozen ops over the whole vocabulary a step (softmax, a partial selection, scatters, two cumulative
// sums, a search), each a dispatch and a pass over tens of thousands of columns; here a row is two passes
// over its logits and a selection among its best candidates. Rows are independent: a row's token never
// depends on which rows share the call.
// verify_tree_sample: a speculative verify's sampled requests, each tree walked by plain decoding's own draw at
// every node the path reaches (the same row, the same filters, the coin of the position the token would take),
// so a sampled request commits the tokens plain decoding would (the torch form filters every node's row first,
// a dozen ops each).
#include "cpu_ops.h"
#include "exp_float.h"
#include "isa_clones.h"
#include "token_bitmask.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace {

// Candidates looked at first for top-k / top-p, four times as many while a row's filter reaches past them
// (kernels/sampling.py's TOP_CANDIDATES: a nucleus rarely holds more than a few dozen tokens).
constexpr int64_t kCandidates = 64;

// torch.argmax's rule: the first maximal value, a NaN counting as the maximum (the first NaN wins); the greedy
// rows of a mixed batch take it over the whole vocabulary, by draft_ops.cpp's vectorised block pass.
int64_t argmax_row(const float* row, int64_t n) { return specjet_cpu::argmax_float_row(row, n); }

struct RowParams {
  float temperature, top_p, min_p, uniform;
  int64_t top_k;
};

constexpr int64_t kBlock = 64;  // columns per block of the weights' maxima and sums

// The largest of row[0 .. n) and whether the row holds a NaN. Explicit 16-lane vectors: the loop form stays
// scalar.
SJ_ISA_CLONES
float row_max(const float* __restrict row, int64_t n, bool* nan_out) {
  typedef float v16f __attribute__((vector_size(64)));
  typedef int32_t v16i __attribute__((vector_size(64)));
  const float minus_inf = -std::numeric_limits<float>::infinity();
  v16f m = v16f{} + minus_inf;
  v16i nan = {};
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    v16f x;
    std::memcpy(&x, row + c, sizeof x);
    nan |= x != x;
    m = x > m ? x : m;
  }
  float best = minus_inf;
  bool any_nan = false;
  for (int i = 0; i < 16; ++i) {
    best = m[i] > best ? m[i] : best;
    any_nan = any_nan || nan[i] != 0;
  }
  for (; c < n; ++c) {
    any_nan = any_nan || std::isnan(row[c]);
    best = row[c] > best ? row[c] : best;
  }
  *nan_out = any_nan;
  return best;
}

// w[c] = exp(row[c] / t - top), 0 below the floor (and more than 87 under the maximum: under 2e-38 of the
// largest weight); per block of 64 columns its largest weight and the sum of its weights (16 lanes, then the
// lanes in order). The weights' loop has no sum in it, so it vectorises; the blocks' sums go by explicit vectors.
SJ_ISA_CLONES
void row_weights(const float* __restrict row, int64_t n, float t, float top, float floor_w, float* __restrict w,
                 float* __restrict block_max, double* __restrict block_sum) {
  for (int64_t c = 0; c < n; ++c) {
    const float d = row[c] / t - top;
    const float v = exp_float(d);
    w[c] = (d < -87.0f || v < floor_w) ? 0.0f : v;
  }
  typedef float v16f __attribute__((vector_size(64)));
  int64_t b = 0;
  for (; (b + 1) * kBlock <= n; ++b) {
    v16f m = {}, sum = {};
    for (int64_t j = 0; j < kBlock; j += 16) {
      v16f x;
      std::memcpy(&x, w + b * kBlock + j, sizeof x);
      m = x > m ? x : m;
      sum += x;
    }
    float bm = 0.0f, bs = 0.0f;
    for (int i = 0; i < 16; ++i) {
      bm = m[i] > bm ? m[i] : bm;
      bs += sum[i];
    }
    block_max[b] = bm;
    block_sum[b] = bs;
  }
  if (b * kBlock < n) {
    float bm = 0.0f, bs = 0.0f;
    for (int64_t c = b * kBlock; c < n; ++c) {
      bm = w[c] > bm ? w[c] : bm;
      bs += w[c];
    }
    block_max[b] = bm;
    block_sum[b] = bs;
  }
}

// A sampled row's filtered distribution (T > 0), unnormalised: a point mass, or weights w_c = exp(l_c / T - max)
// (0 for a forbidden -inf column) under min-p (w >= min_p times the largest, exp(0) = 1) and top-k / top-p (a
// prefix of the descending order: rank < k and the mass before the token under top_p, the first always kept).
struct RowDist {
  int64_t point = -1;  // >= 0: every bit of mass on this column (a NaN or +inf row: torch.argmax's answer)
  bool whole = false;  // no top-k / top-p: every column with a weight is kept (w and the blocks' sums)
  int64_t kept = 0;    // otherwise the kept columns, ids[0 .. kept) in id order
  double total = 0.0;  // the kept weights' sum
};

struct Scratch {
  std::vector<float> w, block_max, maxima;
  std::vector<double> block_sum;
  std::vector<int64_t> ids;
};

// The filtered distribution once the weights, the blocks' maxima and sums are in s (`largest`: the row's largest
// value; `allowed`: the only columns that may hold a weight, in order, or null for every column).
RowDist select_kept(const float* row, int64_t n, const RowParams& p, Scratch& s, float largest,
                    const std::vector<int64_t>* allowed) {
  RowDist d;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const float* w = s.w.data();
  double all = 0.0;
  for (int64_t b = 0; b < blocks; ++b) all += s.block_sum[b];
  if (!((p.top_k > 0 && p.top_k < n) || p.top_p < 1.0f)) {
    d.whole = true;
    d.total = all;
    return d;
  }
  // The best k candidates: every column at least the k-th largest block maximum (k blocks hold a weight that
  // large, so the k largest weights are among them), partially sorted; k grows while the filter reaches past.
  // Top-p measures the nucleus against the whole softmax, min-p's dropped tokens included (the reference filters
  // by top-k / top-p first, then by min-p): their weights are summed back where both filters apply.
  double nucleus_of = all;
  if (p.min_p > 0.0f && p.top_p < 1.0f) {
    const float top = largest / p.temperature;
    auto add_dropped = [&](int64_t c) {
      const float d = row[c] / p.temperature - top;
      if (w[c] == 0.0f && d >= -87.0f) nucleus_of += exp_float(d);
    };
    if (allowed != nullptr) {
      for (const int64_t c : *allowed) add_dropped(c);  // a forbidden column adds nothing (it is -inf)
    } else {
      for (int64_t c = 0; c < n; ++c) add_dropped(c);
    }
  }
  const double nucleus = static_cast<double>(p.top_p) * nucleus_of;
  const int64_t limit = p.top_k > 0 ? std::min(p.top_k, n) : n;
  // Equal weights are ranked by their logits (a huge temperature rounds every weight to 1, which would rank the
  // vocabulary by id), then by id. A larger weight always has the larger logit: this is the logits' order.
  auto heavier = [&](int64_t a, int64_t b) {
    if (w[a] != w[b]) return w[a] > w[b];
    return row[a] > row[b] || (row[a] == row[b] && a < b);
  };
  std::vector<int64_t>& ids = s.ids;
  int64_t k = std::min(limit, kCandidates), kept = 0;
  while (true) {
    ids.clear();
    if (k < blocks) {
      s.maxima.assign(s.block_max.begin(), s.block_max.end());
      std::nth_element(s.maxima.begin(), s.maxima.begin() + (k - 1), s.maxima.end(), std::greater<float>());
      // Never a weightless column (the filter stops at the first): under a grammar most blocks hold none, and a
      // threshold of 0 would otherwise take the whole row.
      const float threshold = std::max(s.maxima[k - 1], std::numeric_limits<float>::min());
      for (int64_t b = 0; b < blocks; ++b) {
        if (s.block_max[b] < threshold) continue;
        for (int64_t c = b * kBlock; c < std::min(n, (b + 1) * kBlock); ++c)
          if (w[c] >= threshold) ids.push_back(c);
      }
    } else {
      for (int64_t b = 0; b < blocks; ++b) {
        if (s.block_max[b] == 0.0f) continue;  // no weight in the block
        for (int64_t c = b * kBlock; c < std::min(n, (b + 1) * kBlock); ++c)
          if (w[c] > 0.0f) ids.push_back(c);
      }
    }
    const int64_t take = std::min<int64_t>(k, ids.size());
    std::partial_sort(ids.begin(), ids.begin() + take, ids.end(), heavier);
    double before = 0.0;
    kept = 0;
    bool decided = false;
    for (int64_t j = 0; j < take; ++j) {
      if (j >= limit || w[ids[j]] == 0.0f || (j > 0 && before >= nucleus)) {
        decided = true;
        break;
      }
      before += w[ids[j]];
      ++kept;
    }
    // Fewer than k candidates: every weighted column is among them (k blocks with a weight would give k).
    if (decided || take < k || k >= limit || k >= n) break;
    k = std::min(limit, 4 * k);
  }
  std::sort(ids.begin(), ids.begin() + kept);
  d.kept = kept;
  for (int64_t j = 0; j < kept; ++j) d.total += w[ids[j]];
  return d;
}

RowDist row_distribution(const float* row, int64_t n, const RowParams& p, Scratch& s) {
  RowDist d;
  bool nan = false;
  const float largest = row_max(row, n, &nan);
  if (nan || largest == std::numeric_limits<float>::infinity()) {
    d.point = argmax_row(row, n);
    return d;
  }
  if (largest == -std::numeric_limits<float>::infinity()) {  // nothing allowed (never under a grammar)
    d.point = 0;
    return d;
  }
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  s.w.resize(n), s.block_max.resize(blocks), s.block_sum.resize(blocks);
  row_weights(row, n, p.temperature, largest / p.temperature, p.min_p > 0.0f ? p.min_p : 0.0f, s.w.data(),
              s.block_max.data(), s.block_sum.data());
  return select_kept(row, n, p, s, largest, nullptr);
}

// Rows whose grammar allows at most this many tokens are drawn from their allowed columns alone (a sparse row:
// a structural token, a number's digits, an enum's values), the others through a masked copy of the row.
constexpr int64_t kSparseAllowed = 2048;

// row_distribution of the masked copy of `row` (its forbidden columns -inf), from the allowed columns alone:
// the same weights, blocks' maxima and sums (each block that holds an allowed column computed by row_weights on
// that block's masked values, the same operations in the same order; a block without one is zero, which the
// dense pass computes for it too) and so the same distribution. `allowed`: the allowed columns in order (the
// mask covering every column). Returns false (nothing decided) where the row holds a NaN or +inf among them or
// allows nothing: the dense path's point masses, left to it. `argmax` gets the first largest allowed column.
bool sparse_row_distribution(const float* row, int64_t n, const std::vector<int64_t>& allowed, const RowParams& p,
                             Scratch& s, RowDist& d, int64_t& argmax) {
  if (allowed.empty()) return false;
  float largest = -std::numeric_limits<float>::infinity();
  argmax = allowed[0];
  for (const int64_t c : allowed) {
    const float v = row[c];
    if (std::isnan(v) || v == std::numeric_limits<float>::infinity()) return false;
    if (v > largest) largest = v, argmax = c;
  }
  if (largest == -std::numeric_limits<float>::infinity()) return false;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  s.w.assign(n, 0.0f), s.block_max.assign(blocks, 0.0f), s.block_sum.assign(blocks, 0.0);
  const float minus_inf = -std::numeric_limits<float>::infinity(), top = largest / p.temperature;
  const float floor_w = p.min_p > 0.0f ? p.min_p : 0.0f;
  float masked[kBlock];
  for (size_t i = 0; i < allowed.size();) {
    const int64_t b = allowed[i] / kBlock, start = b * kBlock, len = std::min(kBlock, n - start);
    std::fill(masked, masked + len, minus_inf);
    for (; i < allowed.size() && allowed[i] < start + len; ++i) masked[allowed[i] - start] = row[allowed[i]];
    row_weights(masked, len, p.temperature, top, floor_w, s.w.data() + start, s.block_max.data() + b,
                s.block_sum.data() + b);
  }
  d = select_kept(row, n, p, s, largest, &allowed);
  return true;
}

// The inverse-CDF draw from d: the first kept column in id order whose running weight exceeds u times the
// total; the row's argmax (``fallback`` where given) where no weight remains.
int64_t draw(const RowDist& d, Scratch& s, const float* row, int64_t n, double u, int64_t fallback = -1) {
  auto argmax = [&] { return fallback >= 0 ? fallback : argmax_row(row, n); };
  if (d.point >= 0) return d.point;
  const float* w = s.w.data();
  if (d.whole) {
    const int64_t blocks = static_cast<int64_t>(s.block_sum.size());
    const double total = d.total;
    if (!(total > 0.0)) return argmax();
    // Walk the blocks' sums, then the block the target falls in.
    const double target = u * total;
    double run = 0.0;
    int64_t b = 0;
    for (; b + 1 < blocks && run + s.block_sum[b] <= target; ++b) run += s.block_sum[b];
    int64_t last = -1;
    for (int64_t c = b * kBlock; c < n; ++c) {
      if (w[c] == 0.0f) continue;
      run += w[c];
      last = c;
      if (run > target) return c;
    }
    for (int64_t c = n - 1; c >= 0 && last < 0; --c)
      if (w[c] != 0.0f) last = c;
    return last;
  }
  double total = 0.0;
  for (int64_t j = 0; j < d.kept; ++j) total += w[s.ids[j]];
  if (!(total > 0.0)) return argmax();
  const double target = u * total;
  double run = 0.0;
  int64_t last = -1;
  for (int64_t j = 0; j < d.kept; ++j) {
    last = s.ids[j];
    run += w[last];
    if (run > target) return last;
  }
  return last;
}

// ``row`` with the columns its token bitmask ``words`` (token_bitmask.h) forbids at -inf, into ``out`` (which may
// be ``row`` itself); columns past the mask's 32 * width stay as they are, as xgrammar leaves them. A word at a
// time: all-forbidden and all-allowed words (most of a grammar's row) as fills and copies.
void mask_row(const float* row, int64_t n, const uint32_t* words, int64_t width, float* out) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const int64_t covered = std::min(n, 32 * width);
  for (int64_t w = 0; w * 32 < covered; ++w) {
    const int64_t start = 32 * w, stop = std::min(covered, start + 32);
    if (words[w] == 0u) {
      std::fill(out + start, out + stop, minus_inf);
    } else if (words[w] == ~0u) {
      if (out != row) std::copy(row + start, row + stop, out + start);
    } else {
      for (int64_t c = start; c < stop; ++c) out[c] = token_allowed(words, c) ? row[c] : minus_inf;
    }
  }
  if (out != row) std::copy(row + covered, row + n, out + covered);
}

// One row's token, as plain decoding draws it: from the row's filtered distribution by the inverse CDF at
// p.uniform where its temperature is positive, else its argmax; with ``bits`` (a token bitmask of ``width``
// words), the row read as if the forbidden columns were -inf, its allowed columns alone where they are few.
// The speculative verify's tree walk draws each node's token through this same function.
int64_t draw_row(const float* row, int64_t cols, const RowParams& p, const uint32_t* bits, int64_t width,
                 Scratch& scratch, std::vector<float>& copy, std::vector<int64_t>& allowed) {
  if (bits != nullptr) {
    if (p.temperature > 0.0f && 32 * width >= cols && count_allowed(bits, width) <= kSparseAllowed) {
      allowed.clear();
      for (int64_t w = 0; w < width; ++w)
        for (uint32_t m = bits[w]; m != 0u; m &= m - 1u) {
          const int64_t c = 32 * w + __builtin_ctz(m);
          if (c < cols) allowed.push_back(c);
        }
      RowDist d;
      int64_t argmax = -1;
      if (sparse_row_distribution(row, cols, allowed, p, scratch, d, argmax))
        return draw(d, scratch, row, cols, p.uniform, argmax);
    }
    copy.resize(cols);
    mask_row(row, cols, bits, width, copy.data());
    row = copy.data();
  }
  return p.temperature > 0.0f ? draw(row_distribution(row, cols, p, scratch), scratch, row, cols, p.uniform)
                              : argmax_row(row, cols);
}

// Each row's token of x [R, V] (contiguous float32) by ``draw_row``, a row flagged in ``masked`` read through its
// ``words`` (width int32 words a row). One row per task: a row's token is the same whichever thread draws it.
void draw_rows(const torch::Tensor& x, const std::function<RowParams(int64_t)>& params, const int32_t* words,
               int64_t width, const std::vector<bool>& masked, int64_t* out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    std::vector<float> copy;
    std::vector<int64_t> allowed;
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t* bits = words != nullptr && masked[r] ? bitmask_row(words, r, width) : nullptr;
      out[r] = draw_row(x.data_ptr<float>() + r * cols, cols, params(r), bits, width, scratch, copy, allowed);
    }
  });
}

// One request's tree, walked as plain decoding would have decoded: at the current node (depth d) its token is
// ``draw_row``'s draw from the node's row with the coin uniforms[d] (the coin of the sequence position that token
// takes), and the walk moves to the first child holding that token; the first node without one ends the path and
// its token is the bonus. Each committed token is thus exactly plain decoding's draw after the same tokens: the
// output is plain decoding's, and so its distribution. ``bits`` (node rows' token bitmasks, ``width`` words each,
// or null rows) as plain decoding reads a constrained row. Writes the path's nodes (root first) to ``path`` and
// returns (path length, bonus).
std::pair<int64_t, int64_t> walk_tree(const float* logits, int64_t vocab, const int64_t* tokens,
                                      const int64_t* parents, const float* uniforms, int64_t nodes,
                                      const std::function<const uint32_t*(int64_t)>& bits, int64_t width,
                                      RowParams p, Scratch& s, std::vector<float>& copy,
                                      std::vector<int64_t>& allowed, int64_t* path) {
  int64_t cur = 0, len = 0;
  path[len++] = 0;
  while (true) {
    p.uniform = uniforms[len - 1];
    const int64_t token = draw_row(logits + cur * vocab, vocab, p, bits(cur), width, s, copy, allowed);
    int64_t next = -1;
    for (int64_t j = cur + 1; j < nodes && next < 0; ++j)
      if (parents[j] == cur && tokens[j] == token) next = j;
    if (next < 0) return {len, token};
    cur = next;
    path[len++] = cur;
  }
}

}  // namespace

namespace specjet_cpu {

std::vector<int64_t> sample_rows_lists(const torch::Tensor& logits, const std::vector<double>& temperatures,
                                       const std::vector<int64_t>& top_ks, const std::vector<double>& top_ps,
                                       const std::vector<double>& min_ps, const std::vector<double>& uniforms,
                                       const c10::optional<torch::Tensor>& bitmask, const std::vector<bool>& masked) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "sample_rows_lists: logits must be a CPU float32 [R, V] tensor");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  TORCH_CHECK(cols > 0, "sample_rows_lists: logits need at least one column");
  for (const size_t size : {temperatures.size(), top_ks.size(), top_ps.size(), min_ps.size(), uniforms.size()})
    TORCH_CHECK(static_cast<int64_t>(size) == rows, "sample_rows_lists: one parameter a row (", rows, " rows)");
  torch::Tensor words;
  int64_t width = 0;
  if (bitmask.has_value()) {
    words = bitmask->contiguous();
    TORCH_CHECK(words.dim() == 2 && words.size(0) == rows && words.scalar_type() == torch::kInt32 && words.device().is_cpu(),
                "sample_rows_lists: the bitmask must be a CPU int32 [R, W] tensor");
    TORCH_CHECK(static_cast<int64_t>(masked.size()) == rows, "sample_rows_lists: one masked flag a row");
    width = words.size(1);
  }
  std::vector<int64_t> ids(rows);
  draw_rows(logits.contiguous(), [&](int64_t r) {
    return RowParams{static_cast<float>(temperatures[r]), static_cast<float>(top_ps[r]), static_cast<float>(min_ps[r]),
                     static_cast<float>(uniforms[r]), top_ks[r]};
  }, width > 0 ? words.data_ptr<int32_t>() : nullptr, width, masked, ids.data());
  return ids;
}

void apply_token_bitmask_rows(torch::Tensor& logits, const torch::Tensor& bitmask, const std::vector<int64_t>& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu() &&
                  logits.is_contiguous(),
              "apply_token_bitmask_rows: logits must be a contiguous CPU float32 [B, V] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.device().is_cpu(),
              "apply_token_bitmask_rows: the bitmask must be a CPU int32 [B, W] tensor");
  for (const int64_t r : rows)
    TORCH_CHECK(r >= 0 && r < logits.size(0) && r < bitmask.size(0), "apply_token_bitmask_rows: row ", r,
                " is out of range");
  const torch::Tensor words = bitmask.contiguous();
  const int64_t cols = logits.size(1), width = words.size(1);
  float* x = logits.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = x + rows[i] * cols;
      mask_row(row, cols, bitmask_row(words.data_ptr<int32_t>(), rows[i], width), width, row);
    }
  });
}

std::vector<torch::Tensor> verify_tree_sample(const torch::Tensor& logits, const torch::Tensor& offsets,
                                              const torch::Tensor& sizes, const torch::Tensor& tokens,
                                              const torch::Tensor& parents, const torch::Tensor& uniforms,
                                              const torch::Tensor& temperatures, const torch::Tensor& top_ks,
                                              const torch::Tensor& top_ps, const torch::Tensor& min_ps,
                                              const c10::optional<torch::Tensor>& bitmask,
                                              const std::vector<bool>& masked) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "verify_tree_sample: logits must be a CPU float32 [R, V] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1), batch = offsets.numel();
  TORCH_CHECK(vocab > 0, "verify_tree_sample: logits need at least one column");
  auto check = [](const torch::Tensor& t, int64_t n, torch::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == type && t.device().is_cpu(),
                "verify_tree_sample: ", name, " must be a CPU [", n, "] tensor of ", c10::toString(type));
  };
  check(offsets, batch, torch::kInt64, "offsets");
  check(sizes, batch, torch::kInt64, "sizes");
  // The requests' nodes one after another: request b's from the sum of the sizes before it.
  const torch::Tensor n = sizes.contiguous();
  std::vector<int64_t> starts(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t size = n.data_ptr<int64_t>()[b];
    TORCH_CHECK(size >= 1 && size <= rows, "verify_tree_sample: every tree has its root and at most the logits' rows");
    starts[b + 1] = starts[b] + size;
  }
  check(tokens, starts[batch], torch::kInt64, "tokens");
  check(parents, starts[batch], torch::kInt64, "parents");
  check(uniforms, starts[batch], torch::kFloat32, "uniforms");
  check(temperatures, batch, torch::kFloat32, "temperatures");
  check(top_ks, batch, torch::kInt64, "top_ks");
  check(top_ps, batch, torch::kFloat32, "top_ps");
  check(min_ps, batch, torch::kFloat32, "min_ps");
  const torch::Tensor x = logits.contiguous(), off = offsets.contiguous(), tok = tokens.contiguous(),
                      par = parents.contiguous(), u = uniforms.contiguous(),
                      t = temperatures.contiguous(), k = top_ks.contiguous(), tp = top_ps.contiguous(),
                      mp = min_ps.contiguous();
  const int64_t *o = off.data_ptr<int64_t>(), *ns = n.data_ptr<int64_t>(), *tk = tok.data_ptr<int64_t>(),
                *pa = par.data_ptr<int64_t>();
  int64_t widest = 1;
  for (int64_t b = 0; b < batch; ++b) {
    // o[b] <= rows - ns[b], not o[b] + ns[b] <= rows: the sum of a huge offset wraps around and would pass.
    TORCH_CHECK(o[b] >= 0 && o[b] <= rows - ns[b], "verify_tree_sample: request ", b, "'s rows fall outside the logits");
    TORCH_CHECK(t.data_ptr<float>()[b] > 0.0f, "verify_tree_sample: request ", b, " is not sampled (temperature <= 0)");
    for (int64_t j = 0; j < ns[b]; ++j) {
      const int64_t node = starts[b] + j;
      TORCH_CHECK(tk[node] >= 0 && tk[node] < vocab, "verify_tree_sample: a token outside the vocabulary");
      TORCH_CHECK(j == 0 ? pa[node] == -1 : (pa[node] >= 0 && pa[node] < j),
                  "verify_tree_sample: parents must be -1 for the root and an earlier node otherwise");
    }
    widest = std::max(widest, ns[b]);
  }
  torch::Tensor words;
  int64_t width = 0;
  if (bitmask.has_value()) {
    words = bitmask->contiguous();
    TORCH_CHECK(words.dim() == 2 && words.scalar_type() == torch::kInt32 && words.device().is_cpu(),
                "verify_tree_sample: the bitmask must be a CPU int32 [R, W] tensor, its rows the logits rows'");
    TORCH_CHECK(static_cast<int64_t>(masked.size()) == words.size(0), "verify_tree_sample: one masked flag a row");
    for (int64_t b = 0; b < batch; ++b)
      TORCH_CHECK(o[b] <= words.size(0) - ns[b],  // the contiguous copy: offsets may be a strided view
                  "verify_tree_sample: request ", b, "'s rows fall outside the bitmask");
    width = words.size(1);
  }
  torch::Tensor path = torch::full({batch, widest}, -1, torch::kInt64), lens = torch::empty({batch}, torch::kInt64),
                bonus = torch::empty({batch}, torch::kInt64);
  int64_t *path_out = path.data_ptr<int64_t>(), *len_out = lens.data_ptr<int64_t>(),
          *bonus_out = bonus.data_ptr<int64_t>();
  // One request per task: its path is the same whichever thread walks it.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    std::vector<float> copy;
    std::vector<int64_t> allowed;
    for (int64_t b = begin; b < end; ++b) {
      const RowParams p{t.data_ptr<float>()[b], tp.data_ptr<float>()[b], mp.data_ptr<float>()[b], 0.0f,
                        k.data_ptr<int64_t>()[b]};
      const auto node_bits = [&](int64_t node) -> const uint32_t* {
        const int64_t r = o[b] + node;
        return width > 0 && masked[r] ? bitmask_row(words.data_ptr<int32_t>(), r, width) : nullptr;
      };
      const auto [len, token] = walk_tree(x.data_ptr<float>() + o[b] * vocab, vocab, tk + starts[b], pa + starts[b],
                                          u.data_ptr<float>() + starts[b], ns[b], node_bits, width, p, scratch, copy,
                                          allowed, path_out + b * widest);
      len_out[b] = len, bonus_out[b] = token;
    }
  });
  return {path, lens, bonus};
}

}  // namespace specjet_cpu
