// The elementwise and per-row parts of a decoder layer for CPU inference, one call each instead of a
// dozen torch ops: RMSNorm (optionally after the residual add), RoPE on q and k with the K/V write
// into the paged pool, and SiLU(gate) * up. At a decode step of a small model these ops, not their
// arithmetic, are most of the time outside the projections.
//
// Batch-invariant by construction: every output row is computed by one thread from its own input row
// in a fixed order (the RMSNorm sum in lanes combined by a fixed tree), whatever the number of rows.
// Compiled with -ffp-contract=off; the row functions are cloned per instruction set with the same
// operations in the same order: one set of bits on every CPU. bf16 rows run on float lanes (converted
// by bit operations that vectorise) and are rounded to bf16 wherever torch's ops would store a bf16
// tensor, so their results are torch's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"
#include "cpu_ops.h"
#include "exp_float.h"
#include "isa_clones.h"

namespace {

inline __attribute__((always_inline)) float round_bf16(float f) {
  const uint32_t bits = bf16_rounded_bits(f);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// Calls fn(T{}) for T = x's dtype, float or c10::BFloat16 (check_rows allows no other).
template <class Fn>
void dispatch(const torch::Tensor& x, Fn&& fn) {
  if (x.scalar_type() == torch::kFloat32) {
    fn(float{});
  } else {
    fn(c10::BFloat16{});
  }
}

// Rows per thread: enough elements to pay for waking a thread.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// sum of squares in 8 float64 lanes, combined by a fixed tree: the same bits for a row in any call
// (and in any instruction set's clone it is inlined into: the lanes are explicit).
inline __attribute__((always_inline)) double sum_squares(const float* x, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      const double v = x[i + l];
      acc[l] += v * v;
    }
  for (int l = 0; i + l < n; ++l) {
    const double v = x[i + l];
    acc[l] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              name, ": expected a contiguous 2-D float32 or bfloat16 CPU tensor");
}

// The row functions below are cloned per instruction set (isa_clones.h): bf16 rows, converted and rounded
// element by element, were several times slower than float rows in the baseline build's four lanes. bf16 rows
// are widened into float scratch (``xf``, ``of``: n floats each) and rounded to bf16 wherever torch's ops would
// store a bf16 tensor.

// out = w * (x * rsqrt(mean(x^2) + eps)); with `residual`, x + residual first, written to sum_out.
SJ_ISA_CLONES
void rms_norm_float_row(const float* x, const float* __restrict residual, const float* __restrict w,
                        float* __restrict sum_out, float* __restrict out, int64_t n, double eps) {
  if (residual) {
    for (int64_t i = 0; i < n; ++i) sum_out[i] = x[i] + residual[i];
    x = sum_out;
  }
  const float inv = static_cast<float>(1.0 / std::sqrt(sum_squares(x, n) / static_cast<double>(n) + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

SJ_ISA_CLONES
void rms_norm_bf16_row(const uint16_t* __restrict x, const uint16_t* __restrict residual, const float* __restrict w,
                       uint16_t* __restrict sum_out, uint16_t* __restrict out, float* __restrict xf,
                       float* __restrict of, int64_t n, double eps) {
  for (int64_t i = 0; i < n; ++i) xf[i] = bf16_to_float(x[i]);
  if (residual) {
    for (int64_t i = 0; i < n; ++i) xf[i] = round_bf16(xf[i] + bf16_to_float(residual[i]));
    for (int64_t i = 0; i < n; ++i) sum_out[i] = static_cast<uint16_t>(bf16_rounded_bits(xf[i]) >> 16);
  }
  const float inv = static_cast<float>(1.0 / std::sqrt(sum_squares(xf, n) / static_cast<double>(n) + eps));
  for (int64_t i = 0; i < n; ++i) of[i] = w[i] * round_bf16(xf[i] * inv);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint16_t>(bf16_rounded_bits(of[i]) >> 16);
}

inline const uint16_t* bf16_bits(const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* bf16_bits(c10::BFloat16* p) { return reinterpret_cast<uint16_t*>(p); }

// A float copy of a bf16 vector (a weight, a row of cos or sin), or the float vector itself.
template <class T>
const float* as_float(const T* p, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else {
    buf.resize(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return buf.data();
  }
}

// out = weight * (x * rsqrt(mean(x^2) + eps)) for rows r0 .. r1 - 1; with `residual`, x + residual first, returned
// too.
template <class T>
void rms_norm_rows(const T* x, const T* residual, const T* w, T* sum_out, T* out, int64_t r0, int64_t r1, int64_t n,
                   double eps) {
  std::vector<float> w_buf, xf(std::is_same_v<T, float> ? 0 : n), of(std::is_same_v<T, float> ? 0 : n);  // bf16 rows
  const float* wf = as_float(w, n, w_buf);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t at = r * n;
    if constexpr (std::is_same_v<T, float>) {
      rms_norm_float_row(x + at, residual ? residual + at : nullptr, wf, residual ? sum_out + at : nullptr, out + at,
                         n, eps);
    } else {
      rms_norm_bf16_row(bf16_bits(x + at), residual ? bf16_bits(residual + at) : nullptr, wf,
                        residual ? bf16_bits(sum_out + at) : nullptr, bf16_bits(out + at), xf.data(), of.data(), n,
                        eps);
    }
  }
}

}  // namespace

namespace specjet_cpu {

RowOp rms_norm_op(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor* residual,
                  torch::Tensor& sum, torch::Tensor& out) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: weight must be contiguous [hidden] of x's dtype");
  if (residual) {
    check_rows(*residual, "rms_norm residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
    fit_output(sum, x.sizes(), x.options());
  }
  fit_output(out, x.sizes(), x.options());
  const int64_t n = x.size(1);
  RowOp op;
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.data_ptr<T>(), *rp = residual ? residual->data_ptr<T>() : nullptr, *wp = weight.data_ptr<T>();
    T *sp = residual ? sum.data_ptr<T>() : nullptr, *outp = out.data_ptr<T>();
    op = RowOp::of(row_grain(n), [=](int64_t r0, int64_t r1) { rms_norm_rows<T>(xp, rp, wp, sp, outp, r0, r1, n, eps); });
  });
  return op;
}

void rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor* residual,
                   torch::Tensor& sum, torch::Tensor& out) {
  run_rows(rms_norm_op(x, weight, eps, residual, sum, out), x.size(0));
}

std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                    const c10::optional<torch::Tensor>& residual) {
  torch::Tensor sum, out;
  rms_norm_into(x, weight, eps, residual ? &*residual : nullptr, sum, out);
  if (residual) return {sum, out};
  return {out};
}

}  // namespace specjet_cpu

namespace {

// One head of neox RoPE (rotate its two halves): y = x1 c - x2 s | x2 c + x1 s, each product and sum
// rounded to float on its own.
SJ_ISA_CLONES
void rotate_float_head(const float* __restrict x, const float* __restrict c, const float* __restrict s,
                       float* __restrict y, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    y[i] = x1 * c[i] - x2 * s[i];
    y[half + i] = x2 * c[i] + x1 * s[i];
  }
}

SJ_ISA_CLONES
void rotate_bf16_head(const uint16_t* __restrict x, const float* __restrict c, const float* __restrict s,
                      uint16_t* __restrict y, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[half + i]);
    y[i] = static_cast<uint16_t>(bf16_rounded_bits(x1 * c[i] - x2 * s[i]) >> 16);
    y[half + i] = static_cast<uint16_t>(bf16_rounded_bits(x2 * c[i] + x1 * s[i]) >> 16);
  }
}

// A float row stored in a bf16 pool: each value rounded to the nearest bf16 (ties to even), as torch's
// .to(torch.bfloat16) rounds it.
SJ_ISA_CLONES
void store_float_as_bf16(const float* __restrict x, uint16_t* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<uint16_t>(bf16_rounded_bits(x[i]) >> 16);
}

// Rows r0 .. r1 - 1 of qkv [T, (H + 2 KV) D] -> q [T, H, D] rotated; k rotated and v written to the pool at
// slots[t] (a pool of type C: T's, or bf16 beside float rows, each value rounded once after the rotation).
// Neox-style RoPE (rotate the two halves of each head); cos, sin [T, D / 2].
template <class T, class C>
void rope_rows(const T* qkv, const T* cos, const T* sin, C* k_cache, C* v_cache, int64_t slot_stride,
               int64_t head_stride, const int64_t* slots, T* q_out, int64_t r0, int64_t r1, int64_t H, int64_t KV,
               int64_t D) {
  const int64_t half = D / 2, width = (H + 2 * KV) * D;
  std::vector<float> c_buf, s_buf, k_buf(std::is_same_v<T, C> ? 0 : D);  // a rotated key before its rounding
  for (int64_t t = r0; t < r1; ++t) {
    const float* c = as_float(cos + t * half, half, c_buf);
    const float* s = as_float(sin + t * half, half, s_buf);
    auto rotate = [&](const T* x, T* y) {
      if constexpr (std::is_same_v<T, float>) {
        rotate_float_head(x, c, s, y, half);
      } else {
        rotate_bf16_head(bf16_bits(x), c, s, bf16_bits(y), half);
      }
    };
    const T* src = qkv + t * width;
    for (int64_t h = 0; h < H; ++h) rotate(src + h * D, q_out + (t * H + h) * D);
    for (int64_t h = 0; h < KV; ++h) {
      C* k_dst = k_cache + slots[t] * slot_stride + h * head_stride;
      C* v_dst = v_cache + slots[t] * slot_stride + h * head_stride;
      if constexpr (std::is_same_v<T, C>) {
        rotate(src + (H + h) * D, k_dst);
        std::memcpy(v_dst, src + (H + KV + h) * D, D * sizeof(T));
      } else {
        static_assert(std::is_same_v<T, float> && std::is_same_v<C, c10::BFloat16>);
        rotate(src + (H + h) * D, k_buf.data());
        store_float_as_bf16(k_buf.data(), bf16_bits(k_dst), D);
        store_float_as_bf16(src + (H + KV + h) * D, bf16_bits(v_dst), D);
      }
    }
  }
}

}  // namespace

namespace specjet_cpu {

RowOp rope_store_op(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                    int64_t num_heads, torch::Tensor& q) {
  check_rows(qkv, "rope_store");
  const int64_t rows = qkv.size(0), KV = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (num_heads + 2 * KV) * D, "rope_store: qkv width ", qkv.size(1),
              " is not (", num_heads, " + 2 x ", KV, ") x ", D);
  const auto cache_dtype = k_cache.scalar_type();
  for (const auto* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == cache_dtype &&
                    (cache_dtype == qkv.scalar_type() || cache_dtype == torch::kBFloat16) && t->dim() == 3 &&
                    t->sizes() == k_cache.sizes() && t->strides() == k_cache.strides() && kv_rows_unit_stride(*t),
                "rope_store: the KV caches must be [slots, KV, D] of qkv's dtype or bfloat16, rows of D contiguous, "
                "both strided alike");
  }
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type() && t->is_contiguous() && t->dim() == 2 && t->size(0) == rows &&
                    t->size(1) == D / 2,
                "rope_store: cos and sin must be contiguous [T, D / 2] of qkv's dtype");
  }
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == rows,
              "rope_store: slots must be contiguous int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < k_cache.size(0), "rope_store: slot ", sp[t], " outside the cache");
  fit_output(q, {rows, num_heads, D}, qkv.options());
  const int64_t slot_stride = k_cache.stride(0), head_stride = k_cache.stride(1), H = num_heads;
  const int64_t grain = row_grain(qkv.size(1));
  if (qkv.scalar_type() == torch::kFloat32 && cache_dtype == torch::kBFloat16) {
    const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
    c10::BFloat16 *kp = k_cache.data_ptr<c10::BFloat16>(), *vp = v_cache.data_ptr<c10::BFloat16>();
    float* qp = q.data_ptr<float>();
    return RowOp::of(grain, [=](int64_t r0, int64_t r1) {
      rope_rows<float, c10::BFloat16>(xp, cp, snp, kp, vp, slot_stride, head_stride, sp, qp, r0, r1, H, KV, D);
    });
  }
  RowOp op;
  dispatch(qkv, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = qkv.data_ptr<T>(), *cp = cos.data_ptr<T>(), *snp = sin.data_ptr<T>();
    T *kp = k_cache.data_ptr<T>(), *vp = v_cache.data_ptr<T>(), *qp = q.data_ptr<T>();
    op = RowOp::of(grain, [=](int64_t r0, int64_t r1) {
      rope_rows<T, T>(xp, cp, snp, kp, vp, slot_stride, head_stride, sp, qp, r0, r1, H, KV, D);
    });
  });
  return op;
}

void rope_store_into(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                     const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                     int64_t num_heads, torch::Tensor& q) {
  run_rows(rope_store_op(qkv, cos, sin, k_cache, v_cache, slots, num_heads, q), qkv.size(0));
}

torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, int64_t num_heads) {
  torch::Tensor q;
  rope_store_into(qkv, cos, sin, k_cache, v_cache, slots, num_heads, q);
  return q;
}

}  // namespace specjet_cpu

namespace {

// silu(g) * u; the bf16 row rounds silu(g) to bf16 before the product, as torch's silu(g) * u does.
SJ_ISA_CLONES
void silu_mul_float_row(const float* __restrict g, const float* __restrict u, float* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    o[i] = (gi / (1.0f + exp_float(-gi))) * u[i];
  }
}

// ``gf``, ``uf``: scratch of n floats each (one loop with the exp and the conversions together does
// not vectorise).
SJ_ISA_CLONES
void silu_mul_bf16_row(const uint16_t* __restrict g, const uint16_t* __restrict u, uint16_t* __restrict o,
                       float* __restrict gf, float* __restrict uf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gf[i] = bf16_to_float(g[i]);
  for (int64_t i = 0; i < n; ++i) uf[i] = bf16_to_float(u[i]);
  for (int64_t i = 0; i < n; ++i) {
    const float gi = gf[i];
    gf[i] = round_bf16(gi / (1.0f + exp_float(-gi))) * uf[i];
  }
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<uint16_t>(bf16_rounded_bits(gf[i]) >> 16);
}

// Rows r0 .. r1 - 1 of gate_up [T, 2 I] -> silu(gate) * up [T, I].
template <class T>
void silu_mul_rows(const T* gu, T* out, int64_t r0, int64_t r1, int64_t inter) {
  std::vector<float> scratch(std::is_same_v<T, float> ? 0 : 2 * inter);
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = gu + r * 2 * inter;
    if constexpr (std::is_same_v<T, float>) {
      silu_mul_float_row(g, g + inter, out + r * inter, inter);
    } else {
      silu_mul_bf16_row(bf16_bits(g), bf16_bits(g + inter), bf16_bits(out + r * inter), scratch.data(),
                        scratch.data() + inter, inter);
    }
  }
}

}  // namespace

namespace specjet_cpu {

RowOp silu_mul_op(const torch::Tensor& gate_up, torch::Tensor& out) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: odd width");
  const int64_t inter = gate_up.size(1) / 2;
  fit_output(out, {gate_up.size(0), inter}, gate_up.options());
  RowOp op;
  dispatch(gate_up, [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.data_ptr<T>();
    T* outp = out.data_ptr<T>();
    op = RowOp::of(row_grain(2 * inter), [=](int64_t r0, int64_t r1) { silu_mul_rows<T>(gp, outp, r0, r1, inter); });
  });
  return op;
}

void silu_mul_into(const torch::Tensor& gate_up, torch::Tensor& out) {
  run_rows(silu_mul_op(gate_up, out), gate_up.size(0));
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  torch::Tensor out;
  silu_mul_into(gate_up, out);
  return out;
}

}  // namespace specjet_cpu
