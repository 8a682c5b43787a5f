// The DFlash trainer's cross-entropy over a chunk of LM-head logits (specjet/train/head_loss.py): per row its
// argmax, its cross-entropy against a target column and the logits' gradient, (softmax - one-hot) * the row's
// share of the loss, stored in the product's dtype for the backward's one product.
//
// torch makes these in a dozen passes over the chunk (the cast to float, log-sum-exp's maximum, difference,
// exponential and sum, the argmax, the softmax again, the one-hot, the scale, the cast back), each a dispatch
// and a walk through a 4 MB chunk; here a row is widened once into a buffer that stays in L1/L2, then gives its
// argmax (the maximum, so no second scan), one exponential per column with their sum, and the scaled store.
// The sums' order is fixed (exp_float.h's sum_exp_lanes), not the instruction set's.
//
// With a teacher (knowledge distillation) the label is (1 - distill) one-hot + distill * softmax(teacher row): the
// teacher's row is widened and exponentiated in the same pass, and the gradient's store takes both softmaxes.
#include "bf16_bits.h"
#include "cpu_ops.h"
#include "exp_float.h"
#include "isa_clones.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
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

// out[i] = e[i] * scale - t[i] * t_scale: a row's softmax minus the teacher's share of the label.
SJ_ISA_CLONES
void two_scales_into_float(const float* __restrict e, float scale, const float* __restrict t, float t_scale,
                           float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = e[i] * scale - t[i] * t_scale;
}

SJ_ISA_CLONES
void two_scales_into_bf16(const float* __restrict e, float scale, const float* __restrict t, float t_scale,
                          uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(bf16_rounded_bits(e[i] * scale - t[i] * t_scale) >> 16);
}

// Sum of t[i] * (x[i] - shift) in a fixed order (eight lanes, then the lanes in turn). With the row's maximum as
// the shift the terms are small, so a row of large logits (a cross-entropy is a difference of such) keeps its digits.
SJ_ISA_CLONES
double weighted_sum(const float* __restrict t, const float* __restrict x, float shift, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += t[i + j] * (x[i + j] - shift);
  double sum = 0.0;
  for (int j = 0; j < 8; ++j) sum += lanes[j];
  for (; i < n; ++i) sum += static_cast<double>(t[i]) * (x[i] - shift);
  return sum;
}

const float* widened_row(const char* base, bool bf16, int64_t r, int64_t cols, std::vector<float>& buffer) {
  if (!bf16) return reinterpret_cast<const float*>(base) + r * cols;
  widen_bf16(reinterpret_cast<const uint16_t*>(base) + r * cols, buffer.data(), cols);
  return buffer.data();
}

SJ_ISA_CLONES
void scale_into_bf16(const float* __restrict e, float scale, uint16_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(bf16_rounded_bits(e[i] * scale) >> 16);
}

}  // namespace

namespace specjet_cpu {

std::vector<torch::Tensor> head_cross_entropy_rows(const torch::Tensor& logits, const torch::Tensor& targets,
                                                   const torch::Tensor& share, torch::Tensor& grad,
                                                   const std::optional<torch::Tensor>& teacher, double distill) {
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
  if (teacher) {
    TORCH_CHECK(teacher->device().is_cpu() && teacher->is_contiguous() && teacher->sizes() == logits.sizes() &&
                    teacher->scalar_type() == logits.scalar_type(),
                "head_cross_entropy_rows: teacher must be a contiguous CPU tensor of logits' shape and dtype");
    TORCH_CHECK(distill >= 0.0 && distill <= 1.0, "head_cross_entropy_rows: distill must lie in [0, 1], got ", distill);
  }
  const char* teacher_in = teacher ? static_cast<const char*>(teacher->data_ptr()) : nullptr;
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
    thread_local std::vector<float> widened, exps, teacher_widened, teacher_exps;
    widened.resize(bf16_in ? cols : 0);
    exps.resize(cols);
    teacher_widened.resize(teacher_in && bf16_in ? cols : 0);
    teacher_exps.resize(teacher_in ? cols : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = widened_row(in, bf16_in, r, cols, widened);
      const int64_t top = argmax_float_row(x, cols);
      const float m = x[top];
      const double sum = exp_and_sum(x, exps.data(), cols, m);
      const int64_t t = target[r];
      const double lse = std::log(sum) + static_cast<double>(m);
      best_out[r] = top;
      const float scale = static_cast<float>(static_cast<double>(shares[r]) / sum);
      // The label: one-hot, or with a teacher its softmax (exponentials over their sum) at `distill`, one-hot the rest.
      const float* teacher_e = nullptr;
      float teacher_scale = 0.0f, at_target;
      if (!teacher_in) {
        ce_out[r] = static_cast<float>(lse - static_cast<double>(x[t]));
        at_target = exps[t] * scale - shares[r];
      } else {
        const float* tx = widened_row(teacher_in, bf16_in, r, cols, teacher_widened);
        const double teacher_sum = exp_and_sum(tx, teacher_exps.data(), cols, tx[argmax_float_row(tx, cols)]);
        // E_teacher[x - m]: the cross-entropy lse - (1 - distill) x[t] - distill E_teacher[x], each term less m.
        const double teacher_dot = weighted_sum(teacher_exps.data(), x, m, cols) / teacher_sum;
        ce_out[r] = static_cast<float>(std::log(sum) + (1.0 - distill) * (static_cast<double>(m) - x[t]) -
                                       distill * teacher_dot);
        teacher_e = teacher_exps.data();
        teacher_scale = static_cast<float>(distill * static_cast<double>(shares[r]) / teacher_sum);
        const float one_hot = static_cast<float>((1.0 - distill) * static_cast<double>(shares[r]));
        at_target = exps[t] * scale - teacher_e[t] * teacher_scale - one_hot;
      }
      if (bf16_out) {
        uint16_t* g = reinterpret_cast<uint16_t*>(out) + r * cols;
        if (teacher_e) two_scales_into_bf16(exps.data(), scale, teacher_e, teacher_scale, g, cols);
        else scale_into_bf16(exps.data(), scale, g, cols);
        g[t] = static_cast<uint16_t>(bf16_rounded_bits(at_target) >> 16);
      } else {
        float* g = reinterpret_cast<float*>(out) + r * cols;
        if (teacher_e) two_scales_into_float(exps.data(), scale, teacher_e, teacher_scale, g, cols);
        else scale_into_float(exps.data(), scale, g, cols);
        g[t] = at_target;
      }
    }
  });
  return {ce, best};
}

}  // namespace specjet_cpu
