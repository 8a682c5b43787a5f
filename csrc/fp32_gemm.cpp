// float32 GEMM for CPU: y[M, N] = x[M, K] @ W (+ bias) with float32 weights and activations, batch-invariant by
// construction. oneDNN's float32 matmul needs a measured row plan to keep a row's bits whatever the call holds
// (kernels/linear.py), and streams the weights of a call of a few rows no faster than its products: a verify of 10
// rows cost about the weights' stream plus all ten rows' products. Here every output is one FMA chain over k in
// order whatever the call holds (fp32_gemm_body.h), and a call's rows share each weight line it loads, with the
// stream kept running beside the products: a one-row call runs at the memory's pace, a verify's rows cost little
// more until their products outlast the stream. The AVX-512 and AVX2 builds give the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "prefetch.h"
#include "token_bitmask.h"

namespace {

enum Isa : int64_t { kNone = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr int64_t kCols = 16;  // columns of a packed group

// Shared by both builds (speed only, never bits): rows a register block holds, groups a set streams together, k
// of a chunk (a set's chunk is 16 KB: it stays in L1 while every block of the call takes it), and how far ahead a
// lone block fetches each group's stream.
constexpr int64_t kRowBlock = 6;
constexpr int64_t kSet = 4;
constexpr int64_t kChunk = 64;
constexpr int64_t kStreamAhead = 16;

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace fp32_avx512 {
// Groups of a register block: 6 rows x 4 groups of sums, 4 weight vectors and the broadcast take 29 of 32 registers.
constexpr int kGroups(int) { return 4; }
#define SJ_VEC 16
#include "fp32_gemm_body.h"
#undef SJ_VEC
}  // namespace fp32_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace fp32_avx2 {
// Groups of a register block, of the 16 registers: 2 vectors a group, so 3-6 rows take one group (up to 12 sums,
// 2 weight vectors and the broadcast), 2 rows two, a lone row four (its weight vectors read by the FMAs themselves).
constexpr int kGroups(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
#define SJ_VEC 8
#include "fp32_gemm_body.h"
#undef SJ_VEC
}  // namespace fp32_avx2
#pragma GCC pop_options

namespace specjet_cpu {

bool fp32_gemm_isa_supported(int64_t isa) {
  switch (isa) {
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default: return false;
  }
}

namespace {

// fp32_gemm's argument checks; returns the weight's column groups.
int64_t check_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                   int64_t isa) {
  TORCH_CHECK(fp32_gemm_isa_supported(isa), "fp32_gemm: instruction set ", isa, " is not supported by this CPU");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "fp32_gemm: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 3 && w.is_contiguous() &&
                  w.size(2) == kCols, "fp32_gemm: w must be a contiguous float32 [N / 16, K, 16] CPU tensor");
  const int64_t groups = w.size(0), N = groups * kCols;
  TORCH_CHECK(w.size(1) == x.size(1), "fp32_gemm: x has ", x.size(1), " columns, the weight takes ", w.size(1));
  if (bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == N, "fp32_gemm: bias must be a contiguous float32 CPU tensor of ", N, " elements");
  }
  return groups;
}

// y[rows, N] = x[rows, K] @ W (+ bias) for checked operands, K > 0, the column groups split between threads; `fused`
// row ops in the same team (cpu_ops.h's run_team: each thread its rows of x before, its rows of y after), or on the
// calling thread's team around a call of fewer rows than threads.
void gemm_rows(const float* xp, int64_t rows, int64_t K, const float* wp, const float* bp, float* yp, int64_t groups,
               int64_t isa, const FusedRows& fused = {}) {
  const int64_t N = groups * kCols;
  // ~64k weights per thread at least.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (kCols * K));
  auto columns = [&](int64_t g0, int64_t g1) {
    if (isa == kAvx512) fp32_avx512::gemm(xp, rows, K, wp, bp, yp, N, g0, g1);
    else fp32_avx2::gemm(xp, rows, K, wp, bp, yp, N, g0, g1);
  };
  if (fused.before || fused.after) {
    const int64_t team = std::min<int64_t>(at::get_num_threads(), (groups + grain - 1) / grain);
    if (team > 1 && rows >= team && !at::in_parallel_region()) {
      run_team(team, rows, groups, fused, [](int64_t, int64_t, int64_t, int64_t) {}, columns);
      return;
    }
    run_around(rows, fused, [&] { at::parallel_for(0, groups, grain, columns); });
    return;
  }
  at::parallel_for(0, groups, grain, columns);
}

}  // namespace

void fp32_gemm_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                    int64_t isa, torch::Tensor& y, const FusedRows& fused) {
  const int64_t groups = check_gemm(x, w, bias, isa), rows = x.size(0), K = x.size(1), N = groups * kCols;
  fit_output(y, {rows, N}, x.options());
  if (rows == 0 || N == 0 || K == 0) {
    run_around(rows, {fused.before, nullptr}, [] {});
    if (K == 0 && rows > 0) {  // no products: every chain is zero
      if (bias) y.copy_(bias->unsqueeze(0).expand({rows, N}));
      else y.zero_();
    }
    run_around(rows, {nullptr, fused.after}, [] {});
    return;
  }
  gemm_rows(x.data_ptr<float>(), rows, K, w.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
            y.data_ptr<float>(), groups, isa, fused);
}

torch::Tensor fp32_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                        int64_t isa) {
  torch::Tensor y;
  fp32_gemm_into(x, w, bias, isa, y);
  return y;
}

torch::Tensor fp32_gemm_masked(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                               int64_t isa, const torch::Tensor& bitmask, const torch::Tensor& masked,
                               int64_t max_allowed) {
  const int64_t groups = check_gemm(x, w, bias, isa), rows = x.size(0), K = x.size(1), N = groups * kCols;
  check_head_mask(bitmask, masked, rows, "fp32_gemm_masked");
  TORCH_CHECK(K > 0, "fp32_gemm_masked: an LM head has inputs (K > 0)");
  if (rows == 0 || N == 0) return fp32_gemm(x, w, bias, isa);
  const MaskedRows split = split_masked_rows(reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()),
                                             bitmask.size(1), masked.data_ptr<bool>(), rows, N, max_allowed);
  constexpr int64_t kItem = 8;  // groups of a work item
  const ListedGroups groups_of = listed_groups_of(split, kCols, kItem);
  auto y = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // The other rows through the full kernel: a row's result does not depend on which rows share a call.
  dense_rows_through<float, float>(
      split.dense, xp, K, N, yp, [&](const float* xs, int64_t n, float* ys) { gemm_rows(xs, n, K, wp, bp, ys, groups, isa); },
      [](float v) { return v; });
  if (split.sparse.empty()) return y;
  std::vector<float> sums(groups_of.list.size() * kCols);  // every listed group's 16 sums, before the bias
  at::parallel_for(0, static_cast<int64_t>(groups_of.item_row.size()), 4, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t i = groups_of.item_row[e], g = groups_of.item_start[e];
      const int64_t n = std::min(kItem, groups_of.at[i + 1] - g);
      const float* xr = xp + split.sparse[i] * K;
      if (isa == kAvx512) fp32_avx512::listed_groups(xr, K, wp, groups_of.list.data() + g, n, sums.data() + g * kCols);
      else fp32_avx2::listed_groups(xr, K, wp, groups_of.list.data() + g, n, sums.data() + g * kCols);
    }
  });
  // + bias as the full call adds it: one float addition of the same two values.
  fill_sparse_rows(split, groups_of, kCols, yp, N, [&](int64_t g, int64_t c) {
    return bp == nullptr ? sums[g * kCols + c % kCols] : sums[g * kCols + c % kCols] + bp[c];
  });
  return y;
}

}  // namespace specjet_cpu
