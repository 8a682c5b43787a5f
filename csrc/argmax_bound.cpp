// argmax_candidates: the columns of an LM head that can hold each row's argmax, from an int8 copy's outputs and
// the bound on its error (specjet/kernels/argmax_bound.py derives the bound and its margins). Two passes: every
// column's bound from the row's activation sizes and the largest lower end among the allowed columns, then the
// columns whose upper end reaches it (or, for a head whose outputs are rounded to bf16, a value that may round to
// the same bf16 number as it), as a grammar-style token bitmask.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_ops.h"
#include "isa_clones.h"

namespace specjet_cpu {
namespace {

constexpr int64_t kBlock = 32;  // the int8 kernel's activation blocks
constexpr int64_t kChunk = 256;  // columns whose bounds one task computes for every row
constexpr float kHalfStep = 0.5005f / 127.0f;  // half an activation step of amax / 127, and its rounding

// The row's features, one per factor row: |x|_1 (for the weights' own error), then each block's half activation
// step (amax_b * kHalfStep, for the activations' error).
void row_features(const float* x, int64_t blocks, float* features) {
  float total = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    float sum = 0.0f, amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float v = std::fabs(x[b * kBlock + i]);
      sum += v;
      amax = std::max(amax, v);
    }
    total += sum;
    features[1 + b] = amax * kHalfStep;
  }
  features[0] = total;
}

// bound[j] = sum_f features[f] * factors[f, j0 + j] for n <= kChunk columns: every term non-negative, so any
// order of the products' sums stays within the margin kernels/argmax_bound.py leaves for their rounding. 64
// columns at a time: four AVX-512 or eight AVX2 registers of sums, which the compiler keeps in registers.
SJ_ISA_CLONES void chunk_bounds(const float* features, const float* factors, int64_t count, int64_t cols, int64_t j0,
                                int64_t n, float* bound) {
  constexpr int64_t kStrip = 64;
  int64_t j = 0;
  for (; j + kStrip <= n; j += kStrip) {
    float acc[kStrip] = {};
    for (int64_t f = 0; f < count; ++f) {
      const float c = features[f];
      const float* row = factors + f * cols + j0 + j;
      for (int64_t l = 0; l < kStrip; ++l) acc[l] += c * row[l];
    }
    std::memcpy(bound + j, acc, sizeof(acc));
  }
  for (; j < n; ++j) {
    float sum = 0.0f;
    for (int64_t f = 0; f < count; ++f) sum += features[f] * factors[f * cols + j0 + j];
    bound[j] = sum;
  }
}

// max_j (approx[j] - bound[j]), in 16 running maxima (a vector's lanes); whether every approx[j] is finite.
SJ_ISA_CLONES float best_lower(const float* approx, const float* bound, int64_t n, bool* finite) {
  float lanes[16];
  for (float& lane : lanes) lane = -std::numeric_limits<float>::infinity();
  uint32_t bad = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) {
      uint32_t bits;
      std::memcpy(&bits, approx + j + l, sizeof(bits));
      bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
      lanes[l] = std::max(lanes[l], approx[j + l] - bound[j + l]);
    }
  float best = -std::numeric_limits<float>::infinity();
  for (float lane : lanes) best = std::max(best, lane);
  for (; j < n; ++j) {
    bad |= static_cast<uint32_t>(!std::isfinite(approx[j]));
    best = std::max(best, approx[j] - bound[j]);
  }
  *finite = bad == 0;
  return best;
}

// Words w0..w1 of the bitmask of columns j with approx[j] + bound[j] >= limit (whole words only: 32 columns each).
__attribute__((target("avx512f"))) void threshold_words_avx512(const float* approx, const float* bound, float limit,
                                                               int64_t w0, int64_t w1, int32_t* out) {
  const __m512 l = _mm512_set1_ps(limit);
  for (int64_t w = w0; w < w1; ++w) {
    const float* a = approx + w * 32;
    const float* b = bound + w * 32;
    const __mmask16 lo = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b)), l, _CMP_GE_OQ);
    const __mmask16 hi =
        _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_loadu_ps(b + 16)), l, _CMP_GE_OQ);
    out[w] = static_cast<int32_t>(static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16));
  }
}

__attribute__((target("avx2"))) void threshold_words_avx2(const float* approx, const float* bound, float limit,
                                                          int64_t w0, int64_t w1, int32_t* out) {
  const __m256 l = _mm256_set1_ps(limit);
  for (int64_t w = w0; w < w1; ++w) {
    uint32_t word = 0;
    for (int q = 0; q < 4; ++q) {
      const float* a = approx + w * 32 + q * 8;
      const float* b = bound + w * 32 + q * 8;
      const __m256 ge = _mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)), l, _CMP_GE_OQ);
      word |= static_cast<uint32_t>(_mm256_movemask_ps(ge)) << (8 * q);
    }
    out[w] = static_cast<int32_t>(word);
  }
}

void threshold_words_scalar(const float* approx, const float* bound, float limit, int64_t w0, int64_t w1,
                            int32_t* out) {
  for (int64_t w = w0; w < w1; ++w) {
    uint32_t word = 0;
    for (int64_t l = 0; l < 32; ++l) word |= static_cast<uint32_t>(approx[w * 32 + l] + bound[w * 32 + l] >= limit) << l;
    out[w] = static_cast<int32_t>(word);
  }
}

using ThresholdWords = void (*)(const float*, const float*, float, int64_t, int64_t, int32_t*);

ThresholdWords threshold_words() {
  static const ThresholdWords chosen = __builtin_cpu_supports("avx512f") ? threshold_words_avx512
                                       : __builtin_cpu_supports("avx2")  ? threshold_words_avx2
                                                                         : threshold_words_scalar;
  return chosen;
}

// The limit below which a column's value rounds (to nearest, to bf16) strictly below whatever `best` rounds to:
// with |best| = m 2^e (m in [0.5, 1)), bf16 numbers near it are at most 2^(e-7) apart, so best's rounding bin
// starts at most 2^(e-7) below best; 2^(e-6) leaves as much again for this subtraction's own rounding. The
// exponent's floor keeps the margin above what flushed tiny products (a bf16 product's DAZ/FTZ) can move a sum.
float bf16_tie_limit(float best) {
  int e = 0;
  std::frexp(std::fabs(best), &e);
  return best - std::ldexp(1.0f, std::max(e, -100) - 6);
}

inline bool allowed_bit(const int32_t* words, int64_t j) {
  return (static_cast<uint32_t>(words[j >> 5]) >> (j & 31)) & 1u;
}

}  // namespace

torch::Tensor argmax_candidates(const torch::Tensor& x, const torch::Tensor& approx, const torch::Tensor& factors,
                                const c10::optional<torch::Tensor>& allowed,
                                const c10::optional<torch::Tensor>& allowed_rows, bool bf16_ties) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(),
              "argmax_candidates: x must be a contiguous CPU float32 [R, K] tensor");
  TORCH_CHECK(approx.device().is_cpu() && approx.scalar_type() == torch::kFloat && approx.dim() == 2 &&
                  approx.is_contiguous() && approx.size(0) == x.size(0),
              "argmax_candidates: approx must be a contiguous CPU float32 [R, V] tensor, a row per row of x");
  const int64_t rows = x.size(0), k = x.size(1), cols = approx.size(1), words = (cols + 31) / 32;
  TORCH_CHECK(k % kBlock == 0 && k > 0, "argmax_candidates: x's width must be whole blocks of 32, got ", k);
  const int64_t blocks = k / kBlock, count = 1 + blocks;
  TORCH_CHECK(factors.device().is_cpu() && factors.scalar_type() == torch::kFloat && factors.is_contiguous() &&
                  factors.dim() == 2 && factors.size(0) == count && factors.size(1) == cols,
              "argmax_candidates: factors must be a contiguous CPU float32 [1 + K / 32, V] tensor");
  const bool masked = allowed.has_value();
  TORCH_CHECK(masked == allowed_rows.has_value(), "argmax_candidates: allowed and allowed_rows go together");
  if (masked) {
    TORCH_CHECK(allowed->scalar_type() == torch::kInt && allowed->is_contiguous() && allowed->dim() == 2 &&
                    allowed->size(0) == rows && allowed->size(1) == words,
                "argmax_candidates: allowed must be a contiguous int32 [R, ceil(V / 32)] bitmask");
    TORCH_CHECK(allowed_rows->scalar_type() == torch::kBool && allowed_rows->is_contiguous() &&
                    allowed_rows->dim() == 1 && allowed_rows->size(0) == rows,
                "argmax_candidates: allowed_rows must be a contiguous bool [R] tensor");
  }
  torch::Tensor out = torch::empty({rows, words}, torch::kInt);
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* ap = approx.data_ptr<float>();
  const float* fp = factors.data_ptr<float>();
  const int32_t* allowed_p = masked ? allowed->data_ptr<int32_t>() : nullptr;
  const bool* flagged = masked ? allowed_rows->data_ptr<bool>() : nullptr;
  int32_t* op = out.data_ptr<int32_t>();
  auto grammar_of = [&](int64_t r) -> const int32_t* {
    return masked && flagged[r] ? allowed_p + r * words : nullptr;
  };
  std::vector<float> features(rows * count);
  for (int64_t r = 0; r < rows; ++r) row_features(xp + r * k, blocks, features.data() + r * count);

  // Pass 1, over column chunks (each chunk's factors read once for every row): the bounds, and each chunk's
  // largest lower end per row.
  const int64_t chunks = (cols + kChunk - 1) / kChunk;
  // Every element is written below; kept by the calling thread between calls, so a decode step's call does not
  // fault in fresh pages for it.
  // (A decode step's or a verify's few rows; a larger call's buffer is its own, not kept.)
  constexpr int64_t kKeptRows = 16;
  thread_local std::vector<float> kept;
  std::vector<float> own;
  std::vector<float>& bounds = rows <= kKeptRows ? kept : own;
  if (bounds.size() < static_cast<size_t>(rows * cols)) bounds.resize(rows * cols);
  float* const bound_rows = bounds.data();  // the workers' own thread_local would be another (empty) vector
  std::vector<float> chunk_best(chunks * rows);
  std::vector<uint8_t> chunk_finite(chunks * rows);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j0 = c * kChunk, n = std::min(kChunk, cols - j0);
      for (int64_t r = 0; r < rows; ++r) {
        float* bound = bound_rows + r * cols + j0;
        const float* a = ap + r * cols + j0;
        chunk_bounds(features.data() + r * count, fp, count, cols, j0, n, bound);
        bool finite = true;
        float best = best_lower(a, bound, n, &finite);
        if (const int32_t* grammar = grammar_of(r)) {
          best = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j)
            if (allowed_bit(grammar, j0 + j)) best = std::max(best, a[j] - bound[j]);
        }
        chunk_best[c * rows + r] = best;
        chunk_finite[c * rows + r] = finite;
      }
    }
  });
  std::vector<float> best(rows, -std::numeric_limits<float>::infinity());
  std::vector<uint8_t> certified(rows, 1);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      best[r] = std::max(best[r], chunk_best[c * rows + r]);
      certified[r] &= chunk_finite[c * rows + r];
    }
  for (int64_t r = 0; r < rows; ++r) {
    certified[r] &= static_cast<uint8_t>(std::isfinite(best[r]));
    if (bf16_ties && certified[r]) best[r] = bf16_tie_limit(best[r]);
  }

  // Pass 2, over words: the columns whose upper end reaches the row's largest lower end (lowered for bf16 ties)
  // within its grammar's allowed ones; a row without a certificate keeps every allowed column.
  at::parallel_for(0, words, 64, [&](int64_t w0, int64_t w1) {
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* grammar = grammar_of(r);
      int32_t* o = op + r * words;
      if (!certified[r]) {
        for (int64_t w = w0; w < w1; ++w) o[w] = grammar != nullptr ? grammar[w] : -1;
        continue;
      }
      const float* a = ap + r * cols;
      const float* bound = bound_rows + r * cols;
      const float limit = best[r];
      const int64_t whole = std::min(w1, cols / 32);  // words of 32 columns; a last partial word below
      if (w0 < whole) threshold_words()(a, bound, limit, w0, whole, o);
      for (int64_t w = std::max(w0, whole); w < w1; ++w) {
        uint32_t word = 0;
        for (int64_t j = w * 32; j < cols; ++j) word |= static_cast<uint32_t>(a[j] + bound[j] >= limit) << (j - w * 32);
        o[w] = static_cast<int32_t>(word);
      }
      if (grammar != nullptr)
        for (int64_t w = w0; w < w1; ++w) o[w] &= grammar[w];
    }
  });
  return out;
}

}  // namespace specjet_cpu
