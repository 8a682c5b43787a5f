// The entry points of specjet's C++ CPU ops, shared by the files of the one extension
// (specjet.kernels._cpu_ops): module.cpp binds them for Python, layer_stack.cpp calls them directly.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <exception>
#include <cstddef>
#include <new>
#include <type_traits>
#include <optional>
#include <vector>

namespace specjet_cpu {

// A KV pool [slots, H_kv, D] laid out slot-major (contiguous) or head-major (the [slots, H_kv, D] view of a
// contiguous [H_kv, slots, D] tensor: a head's keys side by side); either way each row of D is contiguous.
inline bool kv_rows_unit_stride(const torch::Tensor& c) {
  if (c.dim() != 3) return false;
  const int64_t S = c.size(0), KV = c.size(1), D = c.size(2);
  const bool slot_major = c.stride(2) == 1 && c.stride(1) == D && c.stride(0) == KV * D;
  const bool head_major = c.stride(2) == 1 && c.stride(0) == D && c.stride(1) == S * D;
  return slot_major || head_major;
}

// `out` made a contiguous tensor of `sizes` and `options` (a CPU dtype): kept as it is when it already is one, else
// allocated anew. The `_into` ops below write their result there, so a caller that passes the same tensors call
// after call (the layer stack, layer after layer) allocates nothing; an undefined tensor gets a fresh one. `out`
// must not be one of the op's inputs.
inline torch::Tensor& fit_output(torch::Tensor& out, c10::IntArrayRef sizes, const torch::TensorOptions& options) {
  if (!(out.defined() && out.sizes().equals(sizes) && out.scalar_type() == options.dtype().toScalarType() &&
        out.is_contiguous() && out.device().is_cpu()))
    out = torch::empty(sizes, options);
  return out;
}

// A per-row op, checked and its outputs sized, to run on rows r0 .. r1 - 1 at a time. Each output row comes from its
// own input rows alone, in a fixed order, so any split of the rows among threads gives the same bits. `grain`: the
// rows a thread of its own takes at least (enough work to pay for waking one). The op's function (a lambda of
// pointers and sizes) lives inside the RowOp: the layer stack makes four a layer on every forward, decode steps
// included, and a std::function of that many captures would allocate each one.
struct RowOp {
  template <class F>
  static RowOp of(int64_t grain, const F& f) {
    static_assert(sizeof(F) <= kStorage && alignof(F) <= alignof(std::max_align_t) &&
                      std::is_trivially_copyable<F>::value && std::is_trivially_destructible<F>::value,
                  "a RowOp holds a small lambda of plain values");
    RowOp op;
    new (op.storage_) F(f);
    op.call_ = [](const void* fn, int64_t r0, int64_t r1) { (*static_cast<const F*>(fn))(r0, r1); };
    op.grain = grain;
    return op;
  }
  void operator()(int64_t r0, int64_t r1) const { call_(storage_, r0, r1); }

  int64_t grain = 1;

 private:
  static constexpr size_t kStorage = 128;
  alignas(std::max_align_t) unsigned char storage_[kStorage];
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
};

// Every row of `op` on at::parallel_for's threads (the ops' own calls).
inline void run_rows(const RowOp& op, int64_t rows) {
  if (rows > 0) at::parallel_for(0, rows, op.grain, [&op](int64_t r0, int64_t r1) { op(r0, r1); });
}

// Row ops run inside a quantized projection's team of threads (qgemm.cpp): `before` writes the rows of its input
// (each thread its own rows, which it then quantizes), `after` reads the rows of its output once every column is
// computed. Without a team (a call of a few rows) they run on the calling thread around the GEMM.
struct FusedRows {
  const RowOp* before = nullptr;
  const RowOp* after = nullptr;
};

// How many calls ran a team of two threads or more (tests check that a workload reached the team path).
int64_t team_runs();
void count_team_run();

// A GEMM call on one team of `team` threads with fused row ops: thread t of n runs `before` on its rows [rows t / n,
// rows (t + 1) / n), then prepare(t, n, r0, r1) (its share of the call's own preparation, e.g. quantizing), waits for
// the team, computes its share of the column groups (columns(g0, g1): ceil(groups / n) each, as at::parallel_for
// splits them) and, with `after`, waits again and runs `after` on its rows. No exception may leave an OpenMP region:
// a row op's is kept and rethrown after it (the kernels throw none).
template <class Prepare, class Columns>
void run_team(int64_t team, int64_t rows, int64_t groups, const FusedRows& fused, const Prepare& prepare,
              const Columns& columns) {
  count_team_run();
  std::exception_ptr failed;
  auto run_op = [&](const RowOp* op, int64_t r0, int64_t r1) {
    if (op == nullptr || r0 >= r1) return;
    try {
      (*op)(r0, r1);
    } catch (...) {
#pragma omp critical(specjet_team_row_op)
      if (!failed) failed = std::current_exception();
    }
  };
#pragma omp parallel num_threads(team)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t r0 = rows * t / n, r1 = rows * (t + 1) / n;
    run_op(fused.before, r0, r1);
    prepare(t, n, r0, r1);
#pragma omp barrier
    const int64_t chunk = (groups + n - 1) / n, g0 = t * chunk;
    if (g0 < groups) columns(g0, std::min(groups, g0 + chunk));
    if (fused.after) {
#pragma omp barrier
      run_op(fused.after, r0, r1);
    }
  }
  if (failed) std::rethrow_exception(failed);
}

// The same call without a team (a call of a few rows, or where the kernel has no team): the row ops on the calling
// thread's own team around it.
template <class Call>
void run_around(int64_t rows, const FusedRows& fused, const Call& call) {
  if (fused.before) run_rows(*fused.before, rows);
  call();
  if (fused.after) run_rows(*fused.after, rows);
}

// attention.cpp
bool attention_isa_supported(int64_t isa);
int64_t bf16dp_tile_products(int64_t mode);
// acc + hi_a * hi_b + lo_a * lo_b per lane by VDPBF16PS (factors: bf16 values in float32), for the tests of the order
// the bf16dp build relies on (dpbf16_order.h).
torch::Tensor dpbf16_words(const torch::Tensor& acc, const torch::Tensor& hi_a, const torch::Tensor& hi_b,
                           const torch::Tensor& lo_a, const torch::Tensor& lo_b);
void check_attention_batch(int64_t tokens, int64_t num_heads, int64_t head_dim, c10::ScalarType dtype,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& kv_indices,
                           const torch::Tensor& kv_lens, const torch::Tensor& q_lens, const torch::Tensor& q_starts,
                           const c10::optional<torch::Tensor>& custom_mask);
void paged_attention_into(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& kv_indices, const torch::Tensor& kv_lens, const torch::Tensor& q_lens,
                          const torch::Tensor& q_starts, const c10::optional<torch::Tensor>& custom_mask, double scale,
                          int64_t isa, torch::Tensor& out);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& kv_indices, const torch::Tensor& kv_lens,
                              const torch::Tensor& q_lens, const torch::Tensor& q_starts,
                              const c10::optional<torch::Tensor>& custom_mask, double scale, int64_t isa);

// layer_ops.cpp
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                    const c10::optional<torch::Tensor>& residual);
// With `residual`, sum = x + residual too (else `sum` is left alone).
RowOp rms_norm_op(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor* residual,
                  torch::Tensor& sum, torch::Tensor& out);
void rms_norm_into(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor* residual,
                   torch::Tensor& sum, torch::Tensor& out);
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, int64_t num_heads);
RowOp rope_store_op(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                    int64_t num_heads, torch::Tensor& q);
void rope_store_into(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                     const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                     int64_t num_heads, torch::Tensor& q);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
RowOp silu_mul_op(const torch::Tensor& gate_up, torch::Tensor& out);
void silu_mul_into(const torch::Tensor& gate_up, torch::Tensor& out);

// qgemm.cpp
bool qgemm_isa_supported(int64_t isa);
torch::Tensor q4_1_gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                        const torch::Tensor& m, int64_t N, const c10::optional<torch::Tensor>& bias, int64_t isa);
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                        const torch::Tensor& wsum, int64_t group, int64_t N, const c10::optional<torch::Tensor>& bias,
                        int64_t isa);
// `fused`: row ops run in the call's team around the GEMM (x and y must then have their shapes already: y as this
// call sizes it, so it is kept).
void q4_1_gemm_into(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m,
                    int64_t N, const c10::optional<torch::Tensor>& bias, int64_t isa, torch::Tensor& y,
                    const FusedRows& fused = {});
void int8_gemm_into(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& wsum,
                    int64_t group, int64_t N, const c10::optional<torch::Tensor>& bias, int64_t isa, torch::Tensor& y,
                    const FusedRows& fused = {});
torch::Tensor int8_gemm_masked(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s,
                               const torch::Tensor& wsum, int64_t group, int64_t N,
                               const c10::optional<torch::Tensor>& bias, int64_t isa, const torch::Tensor& bitmask,
                               const torch::Tensor& masked, int64_t max_allowed);

bool amx_permitted();  // the CPU has AMX tiles and this process may use them (asked once)
// Whether the AVX-512 Q4_1 kernel gives calls of 12+ rows its 3-group x 4-row tiles (qgemm.cpp: by CPU, once);
// the setter (-1: the CPU's choice, 0 off, 1 on) returns the setting it replaced, for tests of both tilings.
bool q4_1_wide_tiles();
bool set_q4_1_wide_tiles(int64_t mode);

// fp32_gemm.cpp
bool fp32_gemm_isa_supported(int64_t isa);  // 1 AVX2 + FMA, 2 AVX-512F
void fp32_gemm_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                    int64_t isa, torch::Tensor& y, const FusedRows& fused = {});
torch::Tensor fp32_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                        int64_t isa);
torch::Tensor fp32_gemm_masked(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                               int64_t isa, const torch::Tensor& bitmask, const torch::Tensor& masked,
                               int64_t max_allowed);

// bf16_gemm.cpp
bool bf16_gemm_isa_supported(int64_t isa);
bool amx_bf16_supported();  // AMX-BF16 tiles with AVX-512 BF16, usable by this process (asked once)
torch::Tensor bf16_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                        int64_t isa);
// `fused`: row ops in the call's team, as q4_1_gemm_into's (the VDPBF16PS kernel; on AMX tiles around the call).
void bf16_gemm_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                    int64_t isa, torch::Tensor& y, const FusedRows& fused = {});
torch::Tensor bf16_gemm_masked(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                               int64_t isa, const torch::Tensor& bitmask, const torch::Tensor& masked,
                               int64_t max_allowed);
// y[rows, N] (float32) = x[rows, K] (float32) @ W to about 2^-16 of each product (three bf16 tile products:
// hi(x) hi(W) + hi(x) lo(W) + lo(x) hi(W)); w: kernels/bf16_gemm.py's Bf16x3Linear packing. AMX only.
torch::Tensor bf16x3_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
void bf16x3_gemm_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                      torch::Tensor& y);

// draft_ops.cpp
std::vector<torch::Tensor> masked_topk_logp(const torch::Tensor& logits, const c10::optional<torch::Tensor>& bitmask,
                                            const c10::optional<torch::Tensor>& token_ids, int64_t k);
std::tuple<std::vector<std::pair<int64_t, double>>, int64_t> masked_topk_row(
    const torch::Tensor& logits, const c10::optional<torch::Tensor>& bitmask,
    const c10::optional<torch::Tensor>& token_ids, int64_t k);
torch::Tensor masked_argmax(const torch::Tensor& logits, const torch::Tensor& bitmask, const torch::Tensor& masked);
torch::Tensor argmax_rows(const torch::Tensor& logits);
// argmax_bound.cpp: the columns of an LM head that can hold each row's argmax (kernels/argmax_bound.py).
torch::Tensor argmax_candidates(const torch::Tensor& x, const torch::Tensor& approx, const torch::Tensor& factors,
                                const c10::optional<torch::Tensor>& allowed,
                                const c10::optional<torch::Tensor>& allowed_rows, bool bf16_ties);
// argmax_rows of one row of cols > 0 floats (sampling.cpp's greedy rows).
int64_t argmax_float_row(const float* row, int64_t cols);

// head_loss.cpp
// Per row of LM-head logits [R, K] (float32 or bf16): (cross-entropy against targets [R] in float32, argmax [R]),
// with grad [R, K] (float32 or bf16, written) = (softmax - label) * share [R]; the label is one-hot(target), or
// with teacher logits [R, K] (logits' dtype) (1 - distill) one-hot(target) + distill * softmax(teacher), and the
// cross-entropy is against that label.
std::vector<torch::Tensor> head_cross_entropy_rows(const torch::Tensor& logits, const torch::Tensor& targets,
                                                   const torch::Tensor& share, torch::Tensor& grad,
                                                   const std::optional<torch::Tensor>& teacher, double distill);

// sampling.cpp
std::vector<int64_t> sample_rows_lists(const torch::Tensor& logits, const std::vector<double>& temperatures,
                                       const std::vector<int64_t>& top_ks, const std::vector<double>& top_ps,
                                       const std::vector<double>& min_ps, const std::vector<double>& uniforms,
                                       const c10::optional<torch::Tensor>& bitmask, const std::vector<bool>& masked);
void apply_token_bitmask_rows(torch::Tensor& logits, const torch::Tensor& bitmask, const std::vector<int64_t>& rows);
std::vector<torch::Tensor> verify_tree_sample(const torch::Tensor& logits, const torch::Tensor& offsets,
                                              const torch::Tensor& sizes, const torch::Tensor& tokens,
                                              const torch::Tensor& parents, const torch::Tensor& uniforms,
                                              const torch::Tensor& temperatures, const torch::Tensor& top_ks,
                                              const torch::Tensor& top_ps, const torch::Tensor& min_ps,
                                              const c10::optional<torch::Tensor>& bitmask,
                                              const std::vector<bool>& masked);

// layer_stack.cpp (the StackProjection type and the LayerStack class)
void register_layer_stack(pybind11::module& module);

// dflash_block.cpp (after register_layer_stack: it takes StackProjections)
void register_dflash_block(pybind11::module& module);

// thread_pinning.cpp
std::vector<int64_t> pin_team_threads(const std::vector<int64_t>& cpus);

}  // namespace specjet_cpu
