// The DFlash trainer's cross-entropy over a chunk of LM-head logits (specjet/train/head_loss.py): per row its
// argmax, its cross-entropy against a target column and the logits' gradient, (softmax - one-hot) * the row's
// share of the loss, stored in the product's dtype for the backward's one product.
//
// torch makes these in a dozen passes over the chunk (the cast to float, log-sum-exp's maximum, difference,
// exponential and sum, the argmax, the softmax again, the one-hot, the scale, the cast back), each a dispatch
// and a walk through a 4 MB chunk; here a row is widened once into a buffer that stays in L1/L2, then gives its
// argmax (the maximum, so no second scan), one exponential per column with their sum, and the scaled store.
// The sums' order is fixed (exp_float.h's sum_exp_lanes), not the instruction set's.
#include "bf16_bits.h"
#include "cpu_ops.h"
#include "exp_float.h"
#include "isa_clones.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

SJ_ISA_CLONES
void widen_bf16(const uint16_t* __restrict b, float* __restrict f, int64_t n) {
  for (int64_t i = 0; i < n; ++i) f[i] = bf16_to_float(b[i]);
}

// e[i] = exp(x[i] - shift) (shift the row's maximum, so every argument is <= 0); returns the sum of the e[i].
SJ_ISA_CLONES
double exp_and_sum(const float* __restrict x, float* __restrict e, int64_t n, float shift) {
  return sum_exp_lanes<true>(x, e, n, shift);
}

SJ_ISA_CLONES
void scale_into_float(const float* __restrict e, float scale, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = e[i] * scale;
}

SJ_ISA_CLONES
void scale_into_bf16(const float* __restrict e, float scale, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(bf16_rounded_bits(e[i] * scale) >> 16);
}

}  // namespace

namespace specjet_cpu {

std::vector<torch::Tensor> head_cross_entropy_rows(const torch::Tensor& logits, const torch::Tensor& targets,
                                                   const torch::Tensor& share, torch::Tensor& grad) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16),
              "head_cross_entropy_rows: logits must be a contiguous CPU float32 or bfloat16 [R, K] tensor");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  TORCH_CHECK(cols > 0, "head_cross_entropy_rows: rows of no columns have no softmax");
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.sizes() == logits.sizes() &&
                  (grad.scalar_type() == torch::kFloat32 || grad.scalar_type() == torch::kBFloat16),
              "head_cross_entropy_rows: grad must be a contiguous CPU float32 or bfloat16 tensor of logits' shape");
  TORCH_CHECK(targets.device().is_cpu() && targets.scalar_type() == torch::kInt64 && targets.is_contiguous() &&
                  targets.dim() == 1 && targets.size(0) == rows,
              "head_cross_entropy_rows: targets must be a contiguous CPU int64 [R] tensor");
  TORCH_CHECK(share.device().is_cpu() && share.scalar_type() == torch::kFloat32 && share.is_contiguous() &&
                  share.dim() == 1 && share.size(0) == rows,
              "head_cross_entropy_rows: share must be a contiguous CPU float32 [R] tensor");
  const int64_t* target = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(target[r] >= 0 && target[r] < cols, "head_cross_entropy_rows: target ", target[r], " of row ", r,
                " outside the ", cols, " columns");
  torch::Tensor ce = torch::empty({rows}, torch::kFloat32);
  torch::Tensor best = torch::empty({rows}, torch::kInt64);
  const bool bf16_in = logits.scalar_type() == torch::kBFloat16, bf16_out = grad.scalar_type() == torch::kBFloat16;
  const char* in = static_cast<const char*>(logits.data_ptr());
  char* out = static_cast<char*>(grad.data_ptr());
  const float* shares = share.data_ptr<float>();
  float* ce_out = ce.data_ptr<float>();
  int64_t* best_out = best.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> widened, exps;
    widened.resize(bf16_in ? cols : 0);
    exps.resize(cols);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x;
      if (bf16_in) {
        widen_bf16(reinterpret_cast<const uint16_t*>(in) + r * cols, widened.data(), cols);
        x = widened.data();
      } else {
        x = reinterpret_cast<const float*>(in) + r * cols;
      }
      const int64_t top = argmax_float_row(x, cols);
      const float m = x[top];
      const double sum = exp_and_sum(x, exps.data(), cols, m);
      const int64_t t = target[r];
      ce_out[r] = static_cast<float>(std::log(sum) + static_cast<double>(m) - static_cast<double>(x[t]));
      best_out[r] = top;
      const float scale = static_cast<float>(static_cast<double>(shares[r]) / sum);
      const float at_target = exps[t] * scale - shares[r];
      if (bf16_out) {
        uint16_t* g = reinterpret_cast<uint16_t*>(out) + r * cols;
        scale_into_bf16(exps.data(), scale, g, cols);
        g[t] = static_cast<uint16_t>(bf16_rounded_bits(at_target) >> 16);
      } else {
        float* g = reinterpret_cast<float*>(out) + r * cols;
        scale_into_float(exps.data(), scale, g, cols);
        g[t] = at_target;
      }
    }
  });
  return {ce, best};
}

}  // namespace specjet_cpu
