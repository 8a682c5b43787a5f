// Batch-invariant paged attention for CPU, in float32: out[t, h] = softmax(q.K^T * scale) V over the
// keys token t may see, read in place from the paged KV pool (no gather, no copy of the cache).
//
// Invariance by construction: one output row (token t, head h) is computed by one thread from its q
// and the keys and values it may see, taken in position order; masked keys are skipped, never added,
// so a tree node whose ancestors sit between non-ancestors gets the same bits as the same token
// decoded alone, where they are contiguous. No sum is split by the batch, the tile or the thread count.
//
// Float32 sums in 16 fixed lanes (attention_body.h): a bf16 q.k product is exact in float32, and the
// lanes' rounding stays far below the rounding to the model's dtype at the end (bf16), or near the
// float32 model's own (the torch path, specjet/kernels/attention.py, sums in float64; the tests hold
// the two close). Float64 lanes did twice the work, and attention is a third of a decode step.
//
// The `amx` build (CPUs with AMX-BF16; kernels/cpu_ops.py takes it only when asked for) scores a bf16 pool's keys on
// tiles (attention_body.h score_chunk_amx): q split into bf16 hi + lo, each score one key's and one row's sum, so the
// invariance holds as above; its bits differ from the other builds' for bf16 pools (float32 pools take the same
// lanes as the avx512 build). The `bf16dp` build (CPUs with AVX-512 BF16: the default there) computes a bf16 pool's
// products by VDPBF16PS, q and the softmax weights rounded to bf16, each score and each weights x V sum still one
// row's sum in a fixed order (attention_body.h word_lanes, weigh_value_pairs): as invariant, with bits of its own.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cost_shares.h"
#include "cpu_ops.h"
#include "exp_float.h"
#include "prefetch.h"

namespace {

struct Batch {
  int64_t num_heads, num_kv_heads, head_dim, max_kv, max_q;
  const int64_t* kv_indices;  // [B, max_kv]
  const int64_t* kv_lens;
  const int64_t* q_lens;
  const int64_t* q_starts;
  const bool* mask;  // [B, max_q, max_q] or null (causal)
  double scale;
  // Where (slot, KV head)'s D values start in a pool: slot * slot_stride + head * head_stride elements.
  // A head-major pool ([H_kv, slots, D] in memory) keeps a head's keys side by side.
  int64_t slot_stride, head_stride;
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2")
namespace isa_avx512 {
#define SJ_VEC_BYTES 64
#include "attention_body.h"
#undef SJ_VEC_BYTES
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace isa_avx2 {
#define SJ_VEC_BYTES 32
#include "attention_body.h"
#undef SJ_VEC_BYTES
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,amx-tile,amx-bf16")
namespace isa_amx {
#define SJ_VEC_BYTES 64
#define SJ_AMX_SCORES 1
#include "amx_tile_config.h"
#include "attention_body.h"
#undef SJ_AMX_SCORES
#undef SJ_VEC_BYTES
}  // namespace isa_amx
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2")
namespace isa_bf16dp {
#define SJ_VEC_BYTES 64
#define SJ_BF16_SCORES 1
#include "attention_body.h"
#include "dpbf16_order.h"
#undef SJ_BF16_SCORES
#undef SJ_VEC_BYTES
}  // namespace isa_bf16dp
#pragma GCC pop_options

namespace isa_base {
#define SJ_VEC_BYTES 16
#include "attention_body.h"
#undef SJ_VEC_BYTES
}  // namespace isa_base

namespace {

enum Isa : int64_t { kBase = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3, kBf16Dp = 4 };

bool isa_supported(int64_t isa);

bool avx512_bf16_supported() { return isa_supported(kAvx512) && specjet_cpu::bf16_gemm_isa_supported(1); }

// How the bf16dp build computes a tile's products (attention_body.h tile_products_by_fma): by two FMAs for each
// VDPBF16PS on Intel's cores, whose VDPBF16PS issues at half their FMAs' multiply-add rate (bench/RESULTS.md,
// session 93), by the instruction elsewhere; the same bits either way, which dpbf16_order.h's fma_matches_dpbf16
// checks on this CPU before the FMAs are taken. SPECJET_BF16DP_TILE_PRODUCTS=fma|dpbf16 forces one.
// `who`'s request for FMAs refused where this CPU's FMAs do not give VDPBF16PS's bits.
void check_fma_products(const char* who) {
  TORCH_CHECK(isa_bf16dp::fma_matches_dpbf16(), who, ": on this CPU two FMAs do not give VDPBF16PS's bits "
              "(csrc/dpbf16_order.h fma_matches_dpbf16)");
}

void choose_tile_products() {
  const char* forced = std::getenv("SPECJET_BF16DP_TILE_PRODUCTS");
  const std::string name = forced ? forced : "";
  TORCH_CHECK(name.empty() || name == "fma" || name == "dpbf16", "SPECJET_BF16DP_TILE_PRODUCTS=", name,
              ": use fma or dpbf16");
  if (name == "fma") check_fma_products("SPECJET_BF16DP_TILE_PRODUCTS=fma");
  isa_bf16dp::tile_products_by_fma = name.empty() ? __builtin_cpu_is("intel") && isa_bf16dp::fma_matches_dpbf16()
                                                  : name == "fma";
}

// bf16dp needs AVX-512 BF16 and VDPBF16PS's order of adding a word's products (dpbf16_order.h), checked once.
bool dpbf16_in_order() {
  static const bool ok = avx512_bf16_supported() && isa_bf16dp::dpbf16_adds_in_order() && (choose_tile_products(), true);
  return ok;
}

bool isa_supported(int64_t isa) {
  switch (isa) {
    case kBase: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && isa_supported(kAvx2);
    case kAmx:  // the bf16 GEMM's check (asked once: a CPUID in a virtual machine traps to the host)
      return isa_supported(kAvx512) && specjet_cpu::amx_bf16_supported();
    case kBf16Dp: return dpbf16_in_order();
    default: return false;
  }
}

template <class T, class C>
void dispatch(int64_t isa, const Batch& bt, const T* q, const C* k, const C* v, T* out, int64_t batch) {
  if (isa == kAmx) isa_amx::attend_all(bt, q, k, v, out, batch);
  // bf16dp words are pairs of dimensions, 16 a step: another head_dim takes the avx512 lanes (every call of a model
  // has the same head_dim, so all its forwards still compute alike).
  else if (isa == kBf16Dp && bt.head_dim % 32 == 0) isa_bf16dp::attend_all(bt, q, k, v, out, batch);
  else if (isa == kBf16Dp) isa_avx512::attend_all(bt, q, k, v, out, batch);
  else if (isa == kAvx512) isa_avx512::attend_all(bt, q, k, v, out, batch);
  else if (isa == kAvx2) isa_avx2::attend_all(bt, q, k, v, out, batch);
  else isa_base::attend_all(bt, q, k, v, out, batch);
}

}  // namespace

namespace specjet_cpu {

// q [T, H, D]; k_cache, v_cache [slots, H_kv, D] (each (slot, head) row of D contiguous, the two pools
// strided alike: slot-major or a head-major pool's view) of q's dtype (float32 or bfloat16), or bfloat16 beside a
// float32 q (a bf16 KV cache: keys and values widened to float as they are read); kv_indices [B, max_kv],
// kv_lens, q_lens, q_starts [B] int64; custom_mask [B, max_q, max_q] bool or None (causal among the new
// tokens). Returns [T, H, D] in q's dtype.
namespace {

// The checks of paged_attention_into's arguments for q [tokens, H, D] of `dtype` (q's own layout checked by the
// caller), so that nothing outside the tensors is read or written. Returns the batch's view with its mask.
Batch checked_attention_batch(int64_t tokens, int64_t H, int64_t D, c10::ScalarType dtype, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& kv_indices,
                              const torch::Tensor& kv_lens, const torch::Tensor& q_lens, const torch::Tensor& q_starts,
                              const c10::optional<torch::Tensor>& custom_mask, double scale) {
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "attention: float32 or bfloat16 only");
  const auto cache_dtype = k_cache.scalar_type();
  for (const auto* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->device().is_cpu() && c->scalar_type() == cache_dtype &&
                    (cache_dtype == dtype || cache_dtype == torch::kBFloat16) && c->dim() == 3 && c->size(2) == D &&
                    c->sizes() == k_cache.sizes() && c->strides() == k_cache.strides() &&
                    specjet_cpu::kv_rows_unit_stride(*c),
                "attention: the KV caches must be [slots, H_kv, D] of q's dtype or bfloat16, rows of D contiguous, "
                "both strided alike");
  }
  const int64_t batch = kv_lens.numel();
  for (const auto* t : {&kv_lens, &q_lens, &q_starts}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == batch,
                "attention: kv_lens, q_lens and q_starts must be contiguous int64 [B]");
  }
  TORCH_CHECK(kv_indices.device().is_cpu() && kv_indices.scalar_type() == torch::kInt64 && kv_indices.is_contiguous() &&
                  kv_indices.dim() == 2 && kv_indices.size(0) == batch,
              "attention: kv_indices must be contiguous int64 [B, max_kv]");
  const int64_t KV = k_cache.size(1);
  TORCH_CHECK(KV > 0 && H % KV == 0, "attention: heads ", H, " not a multiple of KV heads ", KV);
  Batch bt{H, KV, D, kv_indices.size(1), 0, kv_indices.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
           q_lens.data_ptr<int64_t>(), q_starts.data_ptr<int64_t>(), nullptr, scale, k_cache.stride(0),
           k_cache.stride(1)};
  const int64_t slots = k_cache.size(0);
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t ql = bt.q_lens[b], kl = bt.kv_lens[b];
    // q_starts[b] <= T - q_len, not q_starts[b] + q_len <= T: the sum of a huge start wraps around and would pass.
    TORCH_CHECK(ql >= 1 && ql <= kl && kl <= bt.max_kv && bt.q_starts[b] >= 0 && bt.q_starts[b] <= tokens - ql,
                "attention: request ", b, " has q_len ", ql, ", kv_len ", kl, " outside its tensors");
    for (int64_t p = 0; p < kl; ++p) {
      const int64_t s = bt.kv_indices[b * bt.max_kv + p];
      TORCH_CHECK(s >= 0 && s < slots, "attention: KV slot ", s, " outside the cache of ", slots);
    }
    bt.max_q = std::max(bt.max_q, ql);
    total += ql;
  }
  TORCH_CHECK(total == tokens, "attention: q has ", tokens, " tokens, the requests ", total);
  if (custom_mask) {
    const torch::Tensor& mask = *custom_mask;
    TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == torch::kBool && mask.is_contiguous() &&
                    mask.dim() == 3 && mask.size(0) == batch && mask.size(1) == mask.size(2) &&
                    mask.size(1) >= bt.max_q,
                "attention: custom_mask must be contiguous bool [B, max_q, max_q]");
    bt.max_q = mask.size(1);
    bt.mask = mask.data_ptr<bool>();
  }
  return bt;
}

}  // namespace

// The same checks for a caller that writes the KV pools before its attention runs (LayerStack.run, before its
// first layer), so that a bad batch fails with nothing written.
void check_attention_batch(int64_t tokens, int64_t num_heads, int64_t head_dim, c10::ScalarType dtype,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& kv_indices,
                           const torch::Tensor& kv_lens, const torch::Tensor& q_lens, const torch::Tensor& q_starts,
                           const c10::optional<torch::Tensor>& custom_mask) {
  checked_attention_batch(tokens, num_heads, head_dim, dtype, k_cache, v_cache, kv_indices, kv_lens, q_lens, q_starts,
                          custom_mask, 1.0);
}

// q [T, H, D]; k_cache, v_cache [slots, H_kv, D] (each (slot, head) row of D contiguous, the two pools
// strided alike: slot-major or a head-major pool's view) of q's dtype (float32 or bfloat16), or bfloat16 beside a
// float32 q (a bf16 KV cache: keys and values widened to float as they are read); kv_indices [B, max_kv],
// kv_lens, q_lens, q_starts [B] int64; custom_mask [B, max_q, max_q] bool or None (causal among the new
// tokens). Returns [T, H, D] in q's dtype.
void paged_attention_into(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& kv_indices, const torch::Tensor& kv_lens, const torch::Tensor& q_lens,
                          const torch::Tensor& q_starts, const c10::optional<torch::Tensor>& custom_mask, double scale,
                          int64_t isa, torch::Tensor& out) {
  TORCH_CHECK(isa_supported(isa), "attention: instruction set ", isa, " is not supported by this CPU");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.is_contiguous(), "attention: q must be contiguous [T, H, D] on CPU");
  const auto dtype = q.scalar_type(), cache_dtype = k_cache.scalar_type();
  const Batch bt = checked_attention_batch(q.size(0), q.size(1), q.size(2), dtype, k_cache, v_cache, kv_indices,
                                           kv_lens, q_lens, q_starts, custom_mask, scale);
  const int64_t batch = kv_lens.numel();
  fit_output(out, q.sizes(), q.options());
  if (dtype == torch::kFloat32 && cache_dtype == torch::kFloat32) {
    dispatch(isa, bt, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
             out.data_ptr<float>(), batch);
  } else if (dtype == torch::kFloat32) {
    dispatch(isa, bt, q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
             out.data_ptr<float>(), batch);
  } else {
    dispatch(isa, bt, q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
             v_cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), batch);
  }
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& kv_indices, const torch::Tensor& kv_lens,
                              const torch::Tensor& q_lens, const torch::Tensor& q_starts,
                              const c10::optional<torch::Tensor>& custom_mask, double scale, int64_t isa) {
  torch::Tensor out;
  paged_attention_into(q, k_cache, v_cache, kv_indices, kv_lens, q_lens, q_starts, custom_mask, scale, isa, out);
  return out;
}

bool attention_isa_supported(int64_t isa) { return isa_supported(isa); }

// Sets or asks how the bf16dp build computes a tile's products (choose_tile_products); the mode before the call.
int64_t bf16dp_tile_products(int64_t mode) {
  TORCH_CHECK(dpbf16_in_order(), "bf16dp_tile_products: this CPU does not run the bf16dp build");
  TORCH_CHECK(mode >= -1 && mode <= 1, "bf16dp_tile_products: mode -1 (ask), 0 (VDPBF16PS) or 1 (FMAs)");
  if (mode == 1) check_fma_products("bf16dp_tile_products(1)");
  const int64_t before = isa_bf16dp::tile_products_by_fma;
  if (mode >= 0) isa_bf16dp::tile_products_by_fma = static_cast<int>(mode);
  return before;
}

torch::Tensor dpbf16_words(const torch::Tensor& acc, const torch::Tensor& hi_a, const torch::Tensor& hi_b,
                           const torch::Tensor& lo_a, const torch::Tensor& lo_b) {
  TORCH_CHECK(avx512_bf16_supported(), "dpbf16_words: this CPU has no AVX-512 BF16");
  for (const auto* t : {&acc, &hi_a, &hi_b, &lo_a, &lo_b})
    TORCH_CHECK(t->dtype() == torch::kFloat32 && t->dim() == 1 && t->is_contiguous() && t->numel() == acc.numel() &&
                    t->numel() % 16 == 0,
                "dpbf16_words: five contiguous 1-D float32 tensors of one length, a multiple of 16");
  auto out = torch::empty_like(acc);
  for (int64_t s = 0; s < acc.numel(); s += 16)
    isa_bf16dp::dpbf16_words(acc.data_ptr<float>() + s, hi_a.data_ptr<float>() + s, hi_b.data_ptr<float>() + s,
                             lo_a.data_ptr<float>() + s, lo_b.data_ptr<float>() + s, out.data_ptr<float>() + s);
  return out;
}

}  // namespace specjet_cpu
