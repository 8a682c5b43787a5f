// The elementwise and per-row parts of a decoder layer for CPU inference, one call each instead of a
// dozen torch ops: RMSNorm (optionally after the residual add), RoPE on q and k with the K/V write
// into the paged pool, and SiLU(gate) * up. At a decode step of a small model these ops, not their
// arithmetic, are most of the time outside the projections.
//
// Batch-invariant by construction: every output row is computed by one thread from its own input row
// in a fixed order (the RMSNorm sum in lanes combined by a fixed tree), whatever the number of rows.
// Compiled with -ffp-contract=off, once, for the baseline instruction set: these ops are cheap next
// to the projections, and one build means one set of bits on every CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "exp_float.h"

namespace {

template <class T>
inline float ld(const T* p, int64_t i) { return static_cast<float>(p[i]); }

// Rows per thread: enough elements to pay for waking a thread.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// sum of squares in 8 float64 lanes, combined by a fixed tree: the same bits for a row in any call.
template <class T>
double sum_squares(const T* x, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) {
      const double v = ld(x, i + l);
      acc[l] += v * v;
    }
  for (int l = 0; i + l < n; ++l) {
    const double v = ld(x, i + l);
    acc[l] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              name, ": expected a contiguous 2-D float32 or bfloat16 CPU tensor");
}

// out = weight * (x * rsqrt(mean(x^2) + eps)); with `residual`, x + residual first, returned too.
template <class T>
void rms_norm_rows(const T* x, const T* residual, const T* w, T* sum_out, T* out, int64_t rows, int64_t n,
                   double eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      if (residual) {
        T* s = sum_out + r * n;
        const T* dr = residual + r * n;
        for (int64_t i = 0; i < n; ++i) s[i] = static_cast<T>(ld(xr, i) + ld(dr, i));
        xr = s;
      }
      const float inv = static_cast<float>(1.0 / std::sqrt(sum_squares(xr, n) / static_cast<double>(n) + eps));
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(ld(w, i) * static_cast<float>(static_cast<T>(ld(xr, i) * inv)));
    }
  });
}

std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                    const c10::optional<torch::Tensor>& residual) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: weight must be contiguous [hidden] of x's dtype");
  torch::Tensor sum;
  if (residual) {
    check_rows(*residual, "rms_norm residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
    sum = torch::empty_like(x);
  }
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), residual ? sum.data_ptr<scalar_t>() : nullptr,
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  if (residual) return {sum, out};
  return {out};
}

// qkv [T, (H + 2 KV) D] -> q [T, H, D] rotated; k rotated and v written to the pool at slots[t].
// Neox-style RoPE (rotate the two halves of each head); cos, sin [T, D / 2].
template <class T>
void rope_rows(const T* qkv, const T* cos, const T* sin, T* k_cache, T* v_cache, const int64_t* slots, T* q_out,
               int64_t rows, int64_t H, int64_t KV, int64_t D) {
  const int64_t half = D / 2, width = (H + 2 * KV) * D;
  at::parallel_for(0, rows, row_grain(width), [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const T* src = qkv + t * width;
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      auto rotate = [&](const T* x, T* y) {
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = ld(x, i), x2 = ld(x, half + i), ci = ld(c, i), si = ld(s, i);
          y[i] = static_cast<T>(x1 * ci - x2 * si);
          y[half + i] = static_cast<T>(x2 * ci + x1 * si);
        }
      };
      for (int64_t h = 0; h < H; ++h) rotate(src + h * D, q_out + (t * H + h) * D);
      for (int64_t h = 0; h < KV; ++h) {
        rotate(src + (H + h) * D, k_cache + (slots[t] * KV + h) * D);
        std::memcpy(v_cache + (slots[t] * KV + h) * D, src + (H + KV + h) * D, D * sizeof(T));
      }
    }
  });
}

torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, int64_t num_heads) {
  check_rows(qkv, "rope_store");
  const int64_t rows = qkv.size(0), KV = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (num_heads + 2 * KV) * D, "rope_store: qkv width ", qkv.size(1),
              " is not (", num_heads, " + 2 x ", KV, ") x ", D);
  for (const auto* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type() && t->dim() == 3 && t->is_contiguous() && t->size(1) == KV &&
                    t->size(2) == D,
                "rope_store: the KV caches must be contiguous [slots, KV, D] of qkv's dtype");
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
  auto q = torch::empty({rows, num_heads, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_store", [&] {
    rope_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), sp, q.data_ptr<scalar_t>(), rows,
                        num_heads, KV, D);
  });
  return q;
}

// One float row of silu(g) * u, cloned per instruction set (the widest the CPU runs is picked at
// load): the same IEEE operations in each (no fused products: -ffp-contract=off), so the same bits.
__attribute__((target_clones("avx512f", "avx2", "default")))
void silu_mul_float_row(const float* g, const float* u, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    o[i] = (gi / (1.0f + exp_float(-gi))) * u[i];
  }
}

// gate_up [T, 2 I] -> silu(gate) * up [T, I].
template <class T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, row_grain(2 * inter), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      if constexpr (std::is_same_v<T, float>) {
        silu_mul_float_row(g, u, o, inter);
        continue;
      }
      for (int64_t i = 0; i < inter; ++i) {
        const float gi = ld(g, i);
        o[i] = static_cast<T>(static_cast<float>(static_cast<T>(gi / (1.0f + exp_float(-gi)))) * ld(u, i));
      }
    }
  });
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: odd width");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0),
                            gate_up.size(1) / 2);
  });
  return out;
}

}  // namespace

void register_layer_ops(pybind11::module& module) {
  module.def("rms_norm", &rms_norm, "[x + residual,] weight * x / rms(x) per row");
  module.def("rope_store", &rope_store, "rotate q and k (neox RoPE), write k and v into the pool; returns q");
  module.def("silu_mul", &silu_mul, "silu(gate) * up per row");
}
