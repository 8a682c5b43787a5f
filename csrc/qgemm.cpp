// Weight-only quantized GEMM for CPU: y[M, N] = x[M, K] (fp32) @ W^T, W stored as 32-weight blocks
// (Q4_1: d * q + m with 4-bit q; int8: s * q with one scale per group of 32k weights). Few rows
// (decode, speculative verify) are bound by reading W, so every block is read once per call and
// used for all rows of a row chunk while it sits in cache; the columns are split across threads.
//
// One code path per instruction set (AVX-512, AVX2 + FMA + F16C, scalar), chosen by the caller
// (specjet/kernels/qgemm.py), never by the row count: a row's result must not depend on how many
// rows share the call, which speculative decoding's exactness rests on (see qgemm_body.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;
// Rows per chunk: a chunk's inputs stay in L2 while every column tile streams over them.
constexpr int64_t kRowChunk = 64;
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace isa_avx512 {
constexpr int64_t kBlock = 32;
constexpr int kRows = 4, kCols = 4;  // 16 accumulators of the 32 registers
#define SJ_VEC 16
#include "qgemm_body.h"
#undef SJ_VEC
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
constexpr int64_t kBlock = 32;
constexpr int kRows = 2, kCols = 4;  // 8 accumulators of the 16 registers
#define SJ_VEC 8
#include "qgemm_body.h"
#undef SJ_VEC
}  // namespace isa_avx2
#pragma GCC pop_options

namespace isa_scalar {

static inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// One element at a time, products summed in K order.
static void q4_1(const float* x, int64_t rows, int64_t K, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                 const float* bias, float* y, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * K;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const float db = half_to_float(d[n * nb + b]), mb = half_to_float(m[n * nb + b]);
        const uint8_t* q = qs + n * (K / 2) + b * 16;
        for (int i = 0; i < 16; ++i) acc += xr[b * kBlock + i] * (db * static_cast<float>(q[i] & 0x0F) + mb);
        for (int i = 0; i < 16; ++i) acc += xr[b * kBlock + 16 + i] * (db * static_cast<float>(q[i] >> 4) + mb);
      }
      y[r * N + n] = acc + (bias ? bias[n] : 0.0f);
    }
  }
}

static void int8(const float* x, int64_t rows, int64_t K, const int8_t* q, const uint16_t* s, int64_t group,
                 const float* bias, float* y, int64_t N, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * K;
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k)
        acc += xr[k] * (half_to_float(s[n * (K / group) + k / group]) * static_cast<float>(q[n * K + k]));
      y[r * N + n] = acc + (bias ? bias[n] : 0.0f);
    }
  }
}

}  // namespace isa_scalar

namespace {

bool isa_supported(int64_t isa) {
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && isa_supported(kAvx2);
    default: return false;
  }
}

void check_common(const torch::Tensor& x, int64_t N, const c10::optional<torch::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(isa_supported(isa), "qgemm: instruction set ", isa, " is not supported by this CPU");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "qgemm: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "qgemm: K = ", x.size(1), " is not a multiple of ", kBlock);
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "qgemm: bias must be a contiguous float32 tensor of ", N, " elements");
  }
}

// Splits the columns over the threads in spans of whole column tiles, one row chunk at a time.
template <class Fn>
void parallel_columns(int64_t rows, int64_t N, int64_t K, const Fn& fn) {
  const int64_t tile = 4;
  const int64_t tiles = (N + tile - 1) / tile;
  // Enough work per thread to pay for waking it: about 64k weights.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (tile * K));
  for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
    const int64_t r = std::min(kRowChunk, rows - r0);
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      fn(r0, r, t0 * tile, std::min(N, t1 * tile));
    });
  }
}

torch::Tensor q4_1_gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                        const torch::Tensor& m, const c10::optional<torch::Tensor>& bias, int64_t isa) {
  const int64_t K = x.size(1), N = qs.size(0), rows = x.size(0);
  check_common(x, N, bias, isa);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && qs.dim() == 2 && qs.size(1) * 2 == K,
              "qgemm q4_1: qs must be contiguous uint8 [N, K / 2]");
  for (const auto* t : {&d, &m}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat16 && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / kBlock,
                "qgemm q4_1: d and m must be contiguous float16 [N, K / 32]");
  }
  auto y = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  parallel_columns(rows, N, K, [&](int64_t r0, int64_t r, int64_t n0, int64_t n1) {
    const float* xr = xp + r0 * K;
    float* yr = yp + r0 * N;
    if (isa == kAvx512) isa_avx512::q4_1(xr, r, K, qp, dp, mp, bp, yr, N, n0, n1);
    else if (isa == kAvx2) isa_avx2::q4_1(xr, r, K, qp, dp, mp, bp, yr, N, n0, n1);
    else isa_scalar::q4_1(xr, r, K, qp, dp, mp, bp, yr, N, n0, n1);
  });
  return y;
}

torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, int64_t group,
                        const c10::optional<torch::Tensor>& bias, int64_t isa) {
  const int64_t K = x.size(1), N = q.size(0), rows = x.size(0);
  check_common(x, N, bias, isa);
  TORCH_CHECK(group > 0 && group % kBlock == 0 && K % group == 0,
              "qgemm int8: group must be a multiple of 32 that divides K, got ", group);
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.dim() == 2 && q.size(1) == K,
              "qgemm int8: q must be contiguous int8 [N, K]");
  TORCH_CHECK(s.scalar_type() == torch::kFloat16 && s.is_contiguous() && s.dim() == 2 && s.size(0) == N &&
                  s.size(1) == K / group,
              "qgemm int8: s must be contiguous float16 [N, K / group]");
  auto y = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  parallel_columns(rows, N, K, [&](int64_t r0, int64_t r, int64_t n0, int64_t n1) {
    const float* xr = xp + r0 * K;
    float* yr = yp + r0 * N;
    if (isa == kAvx512) isa_avx512::int8(xr, r, K, qp, sp, group, bp, yr, N, n0, n1);
    else if (isa == kAvx2) isa_avx2::int8(xr, r, K, qp, sp, group, bp, yr, N, n0, n1);
    else isa_scalar::int8(xr, r, K, qp, sp, group, bp, yr, N, n0, n1);
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "specjet's weight-only quantized GEMM (Q4_1 and int8 blocks of 32 weights)";
  module.def("isa_supported", &isa_supported, "whether this CPU runs the given instruction set (0 scalar, 1 AVX2, 2 AVX-512)");
  module.def("q4_1_gemm", &q4_1_gemm, "y = x @ dequant(qs, d, m)^T (+ bias)");
  module.def("int8_gemm", &int8_gemm, "y = x @ dequant(q, s)^T (+ bias)");
}
