// Tokens chosen under a grammar's token bitmask.
// masked_topk_logp: a drafter's best tokens: per row of draft logits, the k best columns among those
// the row's token bitmask allows, with their log-probabilities renormalised over the allowed columns.
// The torch form (kernels/masked_topk.py) takes a dozen small ops a row (unpack the mask, gather, fill,
// log_softmax, topk, filter), each of them a dispatch; a grammar-aware drafter runs it once per block
// position, every iteration. Here it is one pass over the row's columns and one over its allowed logits.
// masked_argmax: plain greedy decoding's token under a grammar, torch.argmax of the masked row in one
// pass, instead of writing -inf over the forbidden logits and reading the whole row again.
#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace specjet_cpu {

std::vector<torch::Tensor> masked_topk_logp(const torch::Tensor& logits, const torch::Tensor& bitmask,
                                            const c10::optional<torch::Tensor>& token_ids, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "masked_topk_logp: logits must be a CPU float32 [R, K] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.device().is_cpu() &&
                  bitmask.size(0) == logits.size(0),
              "masked_topk_logp: bitmask must be a CPU int32 [R, W] tensor, one row per logits row");
  TORCH_CHECK(k >= 1, "masked_topk_logp: k must be >= 1");
  const int64_t rows = logits.size(0), cols = logits.size(1), words_per_row = bitmask.size(1);
  const int64_t vocab = 32 * words_per_row;
  torch::Tensor ids_tensor;
  if (token_ids.has_value()) {
    ids_tensor = token_ids->contiguous();
    TORCH_CHECK(ids_tensor.dim() == 1 && ids_tensor.scalar_type() == torch::kInt64 && ids_tensor.size(0) == cols,
                "masked_topk_logp: token_ids must be int64 [K], the token of each logits column");
  }
  const torch::Tensor x = logits.contiguous(), mask = bitmask.contiguous();
  const int64_t* token = token_ids.has_value() ? ids_tensor.data_ptr<int64_t>() : nullptr;
  torch::Tensor out_ids = torch::full({rows, k}, -1, torch::kInt64);
  torch::Tensor out_logp = torch::full({rows, k}, -std::numeric_limits<float>::infinity(), torch::kFloat32);
  torch::Tensor allowed_count = torch::zeros({rows}, torch::kInt64);
  std::vector<float> top_value(k);
  std::vector<int64_t> top_col(k);
  std::vector<float> kept;  // the row's allowed logits, for the denominator
  kept.reserve(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * cols;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>()) + r * words_per_row;
    auto allowed = [&](int64_t c) {
      const int64_t t = token ? token[c] : c;
      return t >= 0 && t < vocab && ((words[t >> 5] >> (t & 31)) & 1u);
    };
    // Pass 1: the largest allowed logit and the k best allowed finite ones (on a tie the earlier column).
    float max_value = -std::numeric_limits<float>::infinity();
    int64_t found = 0;
    kept.clear();
    for (int64_t c = 0; c < cols; ++c) {
      if (!allowed(c)) continue;
      const float v = row[c];
      kept.push_back(v);
      if (v > max_value) max_value = v;
      if (!std::isfinite(v) || (found == k && !(v > top_value[k - 1]))) continue;
      int64_t j = found < k ? found++ : k - 1;
      while (j > 0 && v > top_value[j - 1]) {
        top_value[j] = top_value[j - 1];
        top_col[j] = top_col[j - 1];
        --j;
      }
      top_value[j] = v;
      top_col[j] = c;
    }
    allowed_count.data_ptr<int64_t>()[r] = static_cast<int64_t>(kept.size());
    if (found == 0 || !std::isfinite(max_value)) continue;
    // Pass 2: the allowed logits' softmax denominator (float terms summed in double: a sequential
    // float sum over tens of thousands of terms drifts by ~1e-4).
    double sum = 0.0;
    for (const float v : kept) sum += std::exp(v - max_value);
    const float log_total = max_value + static_cast<float>(std::log(sum));
    for (int64_t j = 0; j < found; ++j) {
      out_ids.data_ptr<int64_t>()[r * k + j] = token ? token[top_col[j]] : top_col[j];
      out_logp.data_ptr<float>()[r * k + j] = static_cast<float>(top_value[j] - log_total);
    }
  }
  return {out_ids, out_logp, allowed_count};
}

torch::Tensor masked_argmax(const torch::Tensor& logits, const torch::Tensor& bitmask, const torch::Tensor& masked) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "masked_argmax: logits must be a CPU float32 [R, V] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.device().is_cpu() &&
                  bitmask.size(0) == logits.size(0),
              "masked_argmax: bitmask must be a CPU int32 [R, W] tensor, one row per logits row");
  TORCH_CHECK(masked.dim() == 1 && masked.scalar_type() == torch::kBool && masked.size(0) == logits.size(0),
              "masked_argmax: masked must be bool [R]");
  const int64_t rows = logits.size(0), cols = logits.size(1), words_per_row = bitmask.size(1);
  // As xgrammar's apply_token_bitmask_inplace: columns past the mask's 32 W tokens are left as they are.
  const int64_t covered = std::min(cols, 32 * words_per_row);
  const torch::Tensor x = logits.contiguous(), mask = bitmask.contiguous(), flags = masked.contiguous();
  torch::Tensor out = torch::zeros({rows}, torch::kInt64);
  constexpr float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * cols;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>()) + r * words_per_row;
    const bool use_mask = flags.data_ptr<bool>()[r];
    auto value = [&](int64_t c) {
      return (!use_mask || c >= covered || ((words[c >> 5] >> (c & 31)) & 1u)) ? row[c] : minus_inf;
    };
    // torch.argmax's rule: the first maximal value; a NaN is the maximum (the first NaN wins).
    int64_t best = 0;
    float best_value = value(0);
    if (!std::isnan(best_value)) {
      for (int64_t c = 1; c < cols; ++c) {
        const float v = value(c);
        if (std::isnan(v)) {
          best = c;
          break;
        }
        if (v > best_value) {
          best_value = v;
          best = c;
        }
      }
    }
    out.data_ptr<int64_t>()[r] = best;
  }
  return out;
}

}  // namespace specjet_cpu
