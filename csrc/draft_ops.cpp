// Tokens chosen under a grammar's token bitmask.
// masked_topk_logp: a drafter's best tokens: per row of draft logits, the k best columns among those
// the row's token bitmask allows (every column without one), with their log-probabilities renormalised
// over the allowed columns. The torch form (kernels/masked_topk.py) takes a dozen small ops a row
// (unpack the mask, gather, fill, log_softmax, topk, filter), each of them a dispatch; a grammar-aware
// drafter runs it once per block position, every iteration, and an unconstrained one once per block.
// Here it is one pass over the row's columns and one over its allowed logits.
// masked_argmax: plain greedy decoding's token under a grammar, torch.argmax of the masked row in one
// pass, instead of writing -inf over the forbidden logits and reading the whole row again.
// argmax_rows: torch.argmax of unmasked rows by the same vectorised pass: torch's CPU argmax is a generic
// reduction that carries an index through every column, several times slower.
#include "cpu_ops.h"
#include "exp_float.h"
#include "isa_clones.h"
#include "token_bitmask.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <limits>

namespace {

constexpr int64_t kLanes = 16;  // float lanes of the block maxima's vectors

// sum of exp(v[i] - shift) over n floats, in exp_float.h's fixed lane order.
SJ_ISA_CLONES
double sum_exp(const float* __restrict v, int64_t n, float shift) {
  return sum_exp_lanes<false>(v, nullptr, n, shift);
}

constexpr int64_t kBlock = 64;  // values per block of the top-k scan

// out[b]: the largest of v[b * 64 .. b * 64 + 63] (NaN ignored; -inf for a block of none), so a scan reads only
// the blocks that may hold a candidate; returns whether any value may be a NaN (true also for an infinity: the
// masked argmax then takes its exact path). One pass in explicit 16-lane vectors (GCC leaves the loop form scalar).
SJ_ISA_CLONES
bool block_maxima_or_nan(const float* __restrict v, int64_t n, float* __restrict out) {
  typedef float v16f __attribute__((vector_size(64)));
  constexpr float minus_inf = -std::numeric_limits<float>::infinity();
  v16f odd = {};
  int64_t b = 0;
  for (; (b + 1) * kBlock <= n; ++b) {
    v16f m = v16f{} + minus_inf;
    for (int64_t j = 0; j < kBlock / kLanes; ++j) {
      v16f x;
      std::memcpy(&x, v + b * kBlock + j * kLanes, sizeof x);
      odd += x - x;  // 0, or NaN for a NaN or an infinity (a compare x != x is not vectorised here)
      m = x > m ? x : m;
    }
    float top = minus_inf;
    for (int64_t l = 0; l < kLanes; ++l) top = m[l] > top ? m[l] : top;
    out[b] = top;
  }
  bool any = false;
  for (int64_t l = 0; l < kLanes; ++l) any |= odd[l] != odd[l];
  if (b * kBlock < n) {
    float top = minus_inf;
    for (int64_t i = b * kBlock; i < n; ++i) {
      any |= v[i] != v[i];
      top = v[i] > top ? v[i] : top;
    }
    out[b] = top;
  }
  return any;
}

// The columns a bitmask row allows, compacted in column order: their logits into kept and their indices into
// kept_col (cols long at least; cols + kCompactSlack for the AVX-512 form); returns how many. Column c is token
// token[c] (c without token_ids), allowed where it lies within the mask's vocab tokens and its bit is set.
// Every column is written and the count advances by its bit: a branch per column mispredicts on a mask that
// allows about half of them.
int64_t compact_allowed_scalar(const float* row, const int64_t* token, int64_t cols, const uint32_t* words,
                               int64_t vocab, float* kept, int64_t* kept_col, int64_t from = 0, int64_t n = 0) {
  for (int64_t c = from; c < cols; ++c) {  // columns from .. cols - 1, after the n found before them
    const int64_t t = token ? token[c] : c;
    const bool inside = t >= 0 && t < vocab;
    kept[n] = row[c];
    kept_col[n] = c;
    n += inside & token_allowed(words, inside ? t : 0);
  }
  return n;
}

// Which of the 8 columns c .. c + 7 a bitmask row allows (compact_allowed_avx512): a token outside [0, vocab) is
// not, and its word is not read.
__attribute__((target("avx512f"))) inline __mmask8 allowed8(const int64_t* token, int64_t c, const uint32_t* words,
                                                             int64_t vocab) {
  const __m512i step = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i t = token ? _mm512_loadu_si512(token + c) : _mm512_add_epi64(_mm512_set1_epi64(c), step);
  const __mmask8 inside = _mm512_cmpge_epi64_mask(t, _mm512_setzero_si512()) &
                          _mm512_cmplt_epi64_mask(t, _mm512_set1_epi64(vocab));
  const __m256i w = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), inside, _mm512_srli_epi64(t, 5), words, 4);
  const __m512i bit = _mm512_srlv_epi64(_mm512_cvtepu32_epi64(w), _mm512_and_si512(t, _mm512_set1_epi64(31)));
  return _mm512_mask_test_epi64_mask(inside, bit, _mm512_set1_epi64(1));
}

// Elements past the cols a compaction may write (compact_allowed_avx512 stores whole vectors).
constexpr int64_t kCompactSlack = 16;

// compact_allowed_scalar 16 columns at a time: the tokens' words gathered, their bits tested, the allowed logits
// and columns stored by compression. The same compacted arrays (the allowed columns in order), so everything
// after is the same.
__attribute__((target("avx512f"))) int64_t compact_allowed_avx512(const float* row, const int64_t* token,
                                                                   int64_t cols, const uint32_t* words,
                                                                   int64_t vocab, float* kept, int64_t* kept_col) {
  const __m512i step = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t n = 0, c = 0;
  for (; c + 16 <= cols; c += 16) {
    const __mmask8 lo = allowed8(token, c, words, vocab), hi = allowed8(token, c + 8, words, vocab);
    // Compressed in registers, then stored whole (the lanes past the allowed ones are overwritten later or
    // lie in the buffers' slack): a compress straight to memory is microcoded and slow on some CPUs (Zen 4).
    const __mmask16 both = static_cast<__mmask16>(lo | (hi << 8));
    _mm512_storeu_ps(kept + n, _mm512_maskz_compress_ps(both, _mm512_loadu_ps(row + c)));
    _mm512_storeu_si512(kept_col + n, _mm512_maskz_compress_epi64(lo, _mm512_add_epi64(_mm512_set1_epi64(c), step)));
    const int64_t n_lo = __builtin_popcount(lo);
    _mm512_storeu_si512(kept_col + n + n_lo,
                        _mm512_maskz_compress_epi64(hi, _mm512_add_epi64(_mm512_set1_epi64(c + 8), step)));
    n += n_lo + __builtin_popcount(hi);
  }
  return compact_allowed_scalar(row, token, cols, words, vocab, kept, kept_col, c, n);
}

}  // namespace

namespace specjet_cpu {

namespace {

// A drafter's scratch for topk_row, kept across the rows of a call.
struct TopkScratch {
  std::vector<float> top_value, kept, block_max;  // kept: a masked row's allowed logits
  std::vector<int64_t> top_col, kept_col;  // and their columns
};

// One row of masked_topk_logp: the k best allowed columns of row[0 .. cols) into out_ids / out_logp (their
// tokens, best first; `found` of them, the rest left as the caller filled them); returns the allowed count.
// words: the row's bitmask (nullptr: every column allowed), vocab: the tokens it covers.
int64_t topk_row(const float* row, int64_t cols, const uint32_t* words, int64_t vocab, const int64_t* token, int64_t k,
                 TopkScratch& s, int64_t* out_ids, float* out_logp, int64_t& found) {
  const float* values = row;  // the allowed logits (the whole row without a mask)
  const int64_t* column = nullptr;  // their columns (nullptr: value i is column i)
  int64_t n = cols;
  found = 0;
  if (words != nullptr) {
    static const bool avx512 = __builtin_cpu_supports("avx512f");
    s.kept.resize(cols + kCompactSlack);
    s.kept_col.resize(cols + kCompactSlack);
    n = avx512 ? compact_allowed_avx512(row, token, cols, words, vocab, s.kept.data(), s.kept_col.data())
               : compact_allowed_scalar(row, token, cols, words, vocab, s.kept.data(), s.kept_col.data());
    values = s.kept.data();
    column = s.kept_col.data();
  }
  // Pass 1: the largest value and the k best finite ones (on a tie the earlier), a block at a time: a
  // block whose maximum cannot enter the k best is not scanned.
  s.top_value.resize(k);
  s.top_col.resize(k);
  float* top_value = s.top_value.data();
  int64_t* top_col = s.top_col.data();
  s.block_max.resize((n + kBlock - 1) / kBlock);
  // A NaN among the allowed logits makes the softmax NaN: the row has no candidates, as in the torch reference
  // (its log_softmax is NaN throughout), so a drafter's tree is the same on every device.
  if (block_maxima_or_nan(values, n, s.block_max.data()) && std::any_of(values, values + n, [](float v) {
        return std::isnan(v);
      }))
    return n;
  float max_value = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < static_cast<int64_t>(s.block_max.size()); ++b) {
    if (s.block_max[b] > max_value) max_value = s.block_max[b];
    if (found == k && !(s.block_max[b] > top_value[k - 1])) continue;
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
      const float v = values[i];
      if (!std::isfinite(v) || (found == k && !(v > top_value[k - 1]))) continue;
      int64_t j = found < k ? found++ : k - 1;
      while (j > 0 && v > top_value[j - 1]) {
        top_value[j] = top_value[j - 1];
        top_col[j] = top_col[j - 1];
        --j;
      }
      top_value[j] = v;
      top_col[j] = column ? column[i] : i;
    }
  }
  if (found == 0 || !std::isfinite(max_value)) {
    found = 0;
    return n;
  }
  // Pass 2: the allowed logits' softmax denominator.
  const float log_total = max_value + static_cast<float>(std::log(sum_exp(values, n, max_value)));
  for (int64_t j = 0; j < found; ++j) {
    out_ids[j] = token ? token[top_col[j]] : top_col[j];
    out_logp[j] = static_cast<float>(top_value[j] - log_total);
  }
  return n;
}

// token_ids' int64 [cols] data, checked (nullptr without).
const int64_t* checked_token_ids(const c10::optional<torch::Tensor>& token_ids, int64_t cols, torch::Tensor& keep,
                                 const char* op) {
  if (!token_ids.has_value()) return nullptr;
  keep = token_ids->contiguous();
  TORCH_CHECK(keep.dim() == 1 && keep.scalar_type() == torch::kInt64 && keep.size(0) == cols, op,
              ": token_ids must be int64 [K], the token of each logits column");
  return keep.data_ptr<int64_t>();
}

}  // namespace

std::vector<torch::Tensor> masked_topk_logp(const torch::Tensor& logits, const c10::optional<torch::Tensor>& bitmask,
                                            const c10::optional<torch::Tensor>& token_ids, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "masked_topk_logp: logits must be a CPU float32 [R, K] tensor");
  const bool masked = bitmask.has_value();
  TORCH_CHECK(!masked || (bitmask->dim() == 2 && bitmask->scalar_type() == torch::kInt32 &&
                          bitmask->device().is_cpu() && bitmask->size(0) == logits.size(0)),
              "masked_topk_logp: bitmask must be a CPU int32 [R, W] tensor, one row per logits row");
  TORCH_CHECK(k >= 1, "masked_topk_logp: k must be >= 1");
  const int64_t rows = logits.size(0), cols = logits.size(1), words_per_row = masked ? bitmask->size(1) : 0;
  torch::Tensor ids_tensor;
  const int64_t* token = checked_token_ids(token_ids, cols, ids_tensor, "masked_topk_logp");
  const torch::Tensor x = logits.contiguous();
  const torch::Tensor mask = masked ? bitmask->contiguous() : torch::zeros({rows, 0}, torch::kInt32);
  torch::Tensor out_ids = torch::full({rows, k}, -1, torch::kInt64);
  torch::Tensor out_logp = torch::full({rows, k}, -std::numeric_limits<float>::infinity(), torch::kFloat32);
  torch::Tensor allowed_count = torch::zeros({rows}, torch::kInt64);
  TopkScratch scratch;
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* words = masked ? bitmask_row(mask.data_ptr<int32_t>(), r, words_per_row) : nullptr;
    int64_t found = 0;
    allowed_count.data_ptr<int64_t>()[r] =
        topk_row(x.data_ptr<float>() + r * cols, cols, words, 32 * words_per_row, token, k, scratch,
                 out_ids.data_ptr<int64_t>() + r * k, out_logp.data_ptr<float>() + r * k, found);
  }
  return {out_ids, out_logp, allowed_count};
}

std::tuple<std::vector<std::pair<int64_t, double>>, int64_t> masked_topk_row(
    const torch::Tensor& logits, const c10::optional<torch::Tensor>& bitmask,
    const c10::optional<torch::Tensor>& token_ids, int64_t k) {
  TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "masked_topk_row: logits must be a CPU float32 [K] tensor");
  const bool masked = bitmask.has_value();
  TORCH_CHECK(!masked || (bitmask->dim() == 2 && bitmask->size(0) == 1 && bitmask->scalar_type() == torch::kInt32 &&
                          bitmask->device().is_cpu()),
              "masked_topk_row: bitmask must be a CPU int32 [1, W] tensor");
  TORCH_CHECK(k >= 1, "masked_topk_row: k must be >= 1");
  const int64_t cols = logits.size(0);
  torch::Tensor ids_tensor;
  const int64_t* token = checked_token_ids(token_ids, cols, ids_tensor, "masked_topk_row");
  const torch::Tensor x = logits.contiguous();
  torch::Tensor mask;
  if (masked) mask = bitmask->contiguous();
  TopkScratch scratch;
  std::vector<int64_t> ids(k);
  std::vector<float> logp(k);
  int64_t found = 0;
  const uint32_t* words = masked ? bitmask_row(mask.data_ptr<int32_t>(), 0, 0) : nullptr;
  const int64_t allowed = topk_row(x.data_ptr<float>(), cols, words, masked ? 32 * mask.size(1) : 0, token, k, scratch,
                                   ids.data(), logp.data(), found);
  std::vector<std::pair<int64_t, double>> best;
  for (int64_t j = 0; j < found; ++j) best.emplace_back(ids[j], logp[j]);
  return {best, allowed};
}

namespace {

// torch.argmax of ``row`` [cols] with, where ``use_mask``, the columns below ``covered`` that ``words`` forbids read
// as -inf. ``maxima``: scratch for (cols + 63) / 64 floats.
int64_t argmax_row(const float* row, int64_t cols, const uint32_t* words, int64_t covered, bool use_mask,
                   float* maxima) {
  constexpr float minus_inf = -std::numeric_limits<float>::infinity();
  // Masks allowing at most this many columns are walked bit by bit; denser rows go by blocks.
  constexpr int64_t kSparse = 1024;
  auto value = [&](int64_t c) {
    return (!use_mask || c >= covered || token_allowed(words, c)) ? row[c] : minus_inf;
  };
  // torch.argmax's rule: the first maximal value; a NaN is the maximum (the first NaN wins). A column the
  // mask forbids is -inf, which neither beats a value nor is a NaN.
  int64_t best = 0;
  float best_value = value(0);
  auto visit = [&](int64_t c) {  // false: a NaN ends the search
    const float v = value(c);
    if (std::isnan(v)) {
      best = c;
      return false;
    }
    if (v > best_value) {
      best_value = v;
      best = c;
    }
    return true;
  };
  bool sparse = false;  // a mask allowing at most kSparse columns
  if (use_mask) {
    int64_t allowed = 0;
    for (int64_t w = 0; w * 32 < covered; ++w) allowed += __builtin_popcount(words[w]);
    sparse = allowed <= kSparse;
  }
  if (std::isnan(best_value)) {
  } else if (sparse) {
    // A grammar often allows a handful of the vocabulary: visit its columns alone (in increasing order; a
    // forbidden NaN is -inf), then those past the mask's width.
    bool going = true;
    for (int64_t w = 0; going && w * 32 < covered; ++w) {
      uint32_t bits = words[w] & (w == 0 ? ~1u : ~0u);  // column 0 is taken
      while (bits != 0) {
        const int64_t c = w * 32 + __builtin_ctz(bits);
        bits &= bits - 1;
        if (c >= covered || !(going = visit(c))) break;
      }
    }
    for (int64_t c = std::max<int64_t>(covered, 1); going && c < cols; ++c) going = visit(c);
  } else if (!block_maxima_or_nan(row, cols, maxima)) {
    // No NaN: a block of 64 columns can hold the answer only if its largest value (mask aside) beats the
    // best so far, so the vectorised block maxima leave a handful of blocks to visit column by column.
    for (int64_t b = 0; b * kBlock < cols; ++b)
      if (maxima[b] > best_value)
        for (int64_t c = std::max<int64_t>(b * kBlock, 1); c < std::min(cols, (b + 1) * kBlock); ++c) visit(c);
  } else {
    for (int64_t c = 1; c < cols && visit(c); ++c) {
    }
  }
  return best;
}

}  // namespace

torch::Tensor masked_argmax(const torch::Tensor& logits, const torch::Tensor& bitmask, const torch::Tensor& masked) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "masked_argmax: logits must be a CPU float32 [R, V] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.device().is_cpu() &&
                  bitmask.size(0) == logits.size(0),
              "masked_argmax: bitmask must be a CPU int32 [R, W] tensor, one row per logits row");
  TORCH_CHECK(masked.dim() == 1 && masked.scalar_type() == torch::kBool && masked.size(0) == logits.size(0),
              "masked_argmax: masked must be bool [R]");
  const int64_t rows = logits.size(0), cols = logits.size(1), words_per_row = bitmask.size(1);
  TORCH_CHECK(cols > 0, "masked_argmax: rows of no columns have no argmax");
  // As xgrammar's apply_token_bitmask_inplace: columns past the mask's 32 W tokens are left as they are.
  const int64_t covered = std::min(cols, 32 * words_per_row);
  const torch::Tensor x = logits.contiguous(), mask = bitmask.contiguous(), flags = masked.contiguous();
  torch::Tensor out = torch::zeros({rows}, torch::kInt64);
  std::vector<float> maxima((cols + kBlock - 1) / kBlock);
  for (int64_t r = 0; r < rows; ++r)
    out.data_ptr<int64_t>()[r] = argmax_row(x.data_ptr<float>() + r * cols, cols,
                                            bitmask_row(mask.data_ptr<int32_t>(), r, words_per_row), covered,
                                            flags.data_ptr<bool>()[r], maxima.data());
  return out;
}

int64_t argmax_float_row(const float* row, int64_t cols) {
  thread_local std::vector<float> maxima;
  maxima.resize((cols + kBlock - 1) / kBlock);
  return argmax_row(row, cols, nullptr, 0, false, maxima.data());
}

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "argmax_rows: logits must be a CPU float32 [R, V] tensor");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  TORCH_CHECK(cols > 0, "argmax_rows: rows of no columns have no argmax");
  const torch::Tensor x = logits.contiguous();
  torch::Tensor out = torch::empty({rows}, torch::kInt64);
  const float* data = x.data_ptr<float>();
  int64_t* best = out.data_ptr<int64_t>();
  // Rows split between the threads only where each gets at least ~64k columns (a decode step's one row
  // stays on the calling thread).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / cols);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> maxima((cols + kBlock - 1) / kBlock);
    for (int64_t r = r0; r < r1; ++r) best[r] = argmax_row(data + r * cols, cols, nullptr, 0, false, maxima.data());
  });
  return out;
}

}  // namespace specjet_cpu
