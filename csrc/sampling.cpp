// sample_rows: the next token of each row of a plain decode step's logits, drawn from softmax(logits / T)
// under top-k, top-p and min-p by the row's own uniform number (the inverse-CDF draw over the kept tokens in
// token-id order that kernels/sampling.py's reference makes), or the argmax where T <= 0. The torch form
// runs a dozen ops over the whole vocabulary a step (softmax, a partial selection, scatters, two cumulative
// sums, a search), each a dispatch and a pass over tens of thousands of columns; here a row is two passes
// over its logits and a selection among its best candidates. Rows are independent: a row's token never
// depends on which rows share the call.
#include "cpu_ops.h"
#include "exp_float.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// Candidates looked at first for top-k / top-p, four times as many while a row's filter reaches past them
// (kernels/sampling.py's TOP_CANDIDATES: a nucleus rarely holds more than a few dozen tokens).
constexpr int64_t kCandidates = 64;

// torch.argmax's rule: the first maximal value, a NaN counting as the maximum (the first NaN wins).
int64_t argmax_row(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t c = 0; c < n; ++c) {
    if (std::isnan(row[c])) return c;
    if (row[c] > row[best]) best = c;
  }
  return best;
}

struct RowParams {
  float temperature, top_p, min_p, uniform;
  int64_t top_k;
};

constexpr int64_t kBlock = 64;  // columns per block of the weights' maxima and sums

// The largest of row[0 .. n) and whether the row holds a NaN. Explicit 16-lane vectors: the loop form stays
// scalar.
__attribute__((target_clones("avx512f", "avx2", "default")))
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
__attribute__((target_clones("avx512f", "avx2", "default")))
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

// One sampled row (T > 0): weights w_c = exp(l_c / T - max) (0 for a forbidden -inf column), min-p (w >=
// min_p times the largest, exp(0) = 1), top-k / top-p (a prefix of the descending order: rank < k and the
// mass before the token under top_p, the first always kept), then the first kept column in id order whose
// running weight exceeds u times the kept total.
int64_t sample_row(const float* row, int64_t n, const RowParams& p, std::vector<float>& w, std::vector<int64_t>& ids,
                   std::vector<float>& block_max, std::vector<double>& block_sum) {
  bool nan = false;
  const float largest = row_max(row, n, &nan);
  // A NaN or a +inf: no distribution to draw from, torch.argmax's answer.
  if (nan || largest == std::numeric_limits<float>::infinity()) return argmax_row(row, n);
  if (largest == -std::numeric_limits<float>::infinity()) return 0;  // nothing allowed (never under a grammar)
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  w.resize(n), block_max.resize(blocks), block_sum.resize(blocks);
  row_weights(row, n, p.temperature, largest / p.temperature, p.min_p > 0.0f ? p.min_p : 0.0f, w.data(),
              block_max.data(), block_sum.data());
  double all = 0.0;
  for (int64_t b = 0; b < blocks; ++b) all += block_sum[b];
  const bool filtered = (p.top_k > 0 && p.top_k < n) || p.top_p < 1.0f;
  if (!filtered) {  // every kept column: walk the blocks' sums, then the block the target falls in
    const double target = static_cast<double>(p.uniform) * all;
    double run = 0.0;
    int64_t b = 0;
    for (; b + 1 < blocks && run + block_sum[b] <= target; ++b) run += block_sum[b];
    int64_t last = 0;
    for (int64_t c = b * kBlock; c < n; ++c) {
      if (w[c] == 0.0f) continue;
      run += w[c];
      last = c;
      if (run > target) return c;
    }
    for (int64_t c = n - 1; c >= 0 && last == 0; --c)
      if (w[c] != 0.0f) last = c;
    return last;
  }
  // The best k candidates: every column at least the k-th largest block maximum (k blocks hold a weight that
  // large, so the k largest weights are among them), partially sorted; k grows while the filter reaches past.
  const int64_t limit = p.top_k > 0 ? std::min(p.top_k, n) : n;
  auto heavier = [&](int64_t a, int64_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };
  std::vector<float> maxima;
  int64_t k = std::min(limit, kCandidates), kept = 0;
  while (true) {
    ids.clear();
    if (k < blocks) {
      maxima.assign(block_max.begin(), block_max.end());
      std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
      const float threshold = maxima[k - 1];
      for (int64_t b = 0; b < blocks; ++b) {
        if (block_max[b] < threshold) continue;
        for (int64_t c = b * kBlock; c < std::min(n, (b + 1) * kBlock); ++c)
          if (w[c] >= threshold) ids.push_back(c);
      }
    } else {
      for (int64_t c = 0; c < n; ++c) ids.push_back(c);
    }
    const int64_t take = std::min<int64_t>(k, ids.size());
    std::partial_sort(ids.begin(), ids.begin() + take, ids.end(), heavier);
    double before = 0.0;
    kept = 0;
    bool decided = false;
    for (int64_t j = 0; j < take; ++j) {
      if (j >= limit || w[ids[j]] == 0.0f || (j > 0 && before >= static_cast<double>(p.top_p) * all)) {
        decided = true;
        break;
      }
      before += w[ids[j]];
      ++kept;
    }
    if (decided || k >= limit || k >= n) break;
    k = std::min(limit, 4 * k);
  }
  // The kept candidates in id order, drawn from.
  std::sort(ids.begin(), ids.begin() + kept);
  double total = 0.0;
  for (int64_t j = 0; j < kept; ++j) total += w[ids[j]];
  const double target = static_cast<double>(p.uniform) * total;
  double run = 0.0;
  for (int64_t j = 0; j < kept; ++j) {
    run += w[ids[j]];
    if (run > target) return ids[j];
  }
  return ids[kept - 1];
}

}  // namespace

namespace specjet_cpu {

torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& temperatures, const torch::Tensor& top_ks,
                          const torch::Tensor& top_ps, const torch::Tensor& min_ps, const torch::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "sample_rows: logits must be a CPU float32 [R, V] tensor");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  TORCH_CHECK(cols > 0, "sample_rows: logits need at least one column");
  auto check = [&](const torch::Tensor& t, torch::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == type && t.device().is_cpu(),
                "sample_rows: ", name, " must be a CPU [R] tensor of ", c10::toString(type));
  };
  check(temperatures, torch::kFloat32, "temperatures");
  check(top_ks, torch::kInt64, "top_ks");
  check(top_ps, torch::kFloat32, "top_ps");
  check(min_ps, torch::kFloat32, "min_ps");
  check(uniforms, torch::kFloat32, "uniforms");
  const torch::Tensor x = logits.contiguous(), t = temperatures.contiguous(), k = top_ks.contiguous(),
                      tp = top_ps.contiguous(), mp = min_ps.contiguous(), u = uniforms.contiguous();
  torch::Tensor out = torch::empty({rows}, torch::kInt64);
  int64_t* ids = out.data_ptr<int64_t>();
  // One row per task: its token is the same whichever thread draws it.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w, block_max;
    std::vector<double> block_sum;
    std::vector<int64_t> order;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x.data_ptr<float>() + r * cols;
      const RowParams p{t.data_ptr<float>()[r], tp.data_ptr<float>()[r], mp.data_ptr<float>()[r],
                        u.data_ptr<float>()[r], k.data_ptr<int64_t>()[r]};
      ids[r] = p.temperature > 0.0f ? sample_row(row, cols, p, w, order, block_max, block_sum) : argmax_row(row, cols);
    }
  });
  return out;
}

}  // namespace specjet_cpu
