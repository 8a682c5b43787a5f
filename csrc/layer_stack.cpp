// A model's decoder layers run in one call: for each layer the calls models/llama.py's
// `DecoderLayer.forward_native` makes (RMSNorm, q|k|v projection, RoPE + K/V write, paged attention,
// o projection, RMSNorm after the residual add, gate|up projection, SiLU-and-multiply, down
// projection, residual add), with the same kernels and the same arguments, so every layer gives the
// same bits as the Python loop. What goes is the Python between the calls (attribute lookups,
// wrappers, argument checks), which at batch 1 costs about as much as a quantized layer's
// attention. The per-batch arguments (attention metadata, RoPE tables, KV slots) are passed once for
// all layers, and the layers' intermediates live in tensors of the run that each layer writes again
// (cpu_ops.h's _into ops), so a layer allocates nothing.
//
// A projection is one of specjet's inference operands (csrc/stack_projection.h).
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "stack_projection.h"

namespace {

using specjet_cpu::Projection;
using specjet_cpu::kQ41;
using specjet_cpu::kInt8;
using specjet_cpu::kOneDnn;
using specjet_cpu::kDense;
using specjet_cpu::kBf16;
using specjet_cpu::kBf16x3;
using specjet_cpu::kFp32;
using specjet_cpu::onednn_linear_op;
using specjet_cpu::rows_of;

struct Layer {
  torch::Tensor norm1, norm2;
  double eps1, eps2;
  Projection qkv, o, gate_up, down;
};

class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t head_dim, double scale) : num_heads_(num_heads), head_dim_(head_dim), scale_(scale) {}

  void add_layer(torch::Tensor norm1, double eps1, torch::Tensor norm2, double eps2, Projection qkv, Projection o,
                 Projection gate_up, Projection down) {
    layers_.push_back({std::move(norm1), std::move(norm2), eps1, eps2, std::move(qkv), std::move(o),
                       std::move(gate_up), std::move(down)});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, hidden] through every layer; k_cache, v_cache [layers, slots, H_kv, D]; the attention's
  // metadata as kernels/cpu_ops.py's native_attention passes it. Returns the last layer's output and
  // the outputs of the layers listed in `capture` (increasing indices), in that order.
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> run(
      torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_cache,
      const torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& kv_indices,
      const torch::Tensor& kv_lens, const torch::Tensor& q_lens, const torch::Tensor& q_starts,
      const c10::optional<torch::Tensor>& mask, int64_t attention_isa, const std::vector<int64_t>& capture) const {
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) == size() && v_cache.size(0) == size(),
                "layer stack: the KV caches must be [", size(), " layers, slots, H_kv, D]");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "layer stack: x must be contiguous [T, hidden]");
    for (size_t i = 0; i < capture.size(); ++i) {  // checked before any layer writes the KV pools
      TORCH_CHECK(capture[i] >= 0 && capture[i] < size() && (i == 0 || capture[i] > capture[i - 1]),
                  "layer stack: capture must list increasing layer indices below ", size());
    }
    const int64_t tokens = x.size(0);
    // The attention's metadata too: layer 0 writes its keys and values before its attention would check them.
    if (size() > 0)
      specjet_cpu::check_attention_batch(tokens, num_heads_, head_dim_, x.scalar_type(), k_cache.select(0, 0),
                                         v_cache.select(0, 0), kv_indices, kv_lens, q_lens, q_starts, mask);
    std::vector<torch::Tensor> taken;
    size_t next = 0;
    // Every intermediate of a layer in a tensor of the run's, written again by the next layer (cpu_ops.h's _into
    // ops): one allocation per run instead of a dozen per layer. The residual stream alternates between two
    // sums, so a norm never writes the tensor it reads; each layer's MLP output is added by the next layer's
    // input norm (pending), as RMSNorm's residual form computes x + residual exactly as the separate add did.
    torch::Tensor h, qkv, q, attended, flat, o, gate_up, act, down, sums[2], unused;
    int which = 0;
    bool pending = false;  // the stream is x + down
    for (int64_t l = 0; l < size(); ++l) {
      const Layer& layer = layers_[l];
      torch::Tensor k = k_cache.select(0, l), v = v_cache.select(0, l);
      // The input norm (of x + down where pending) and, after q|k|v, RoPE with the KV write: on a quantized or bf16
      // weight both run in the projection's team of threads, each thread on its own rows (the same bits as apart).
      const torch::Tensor* residual = pending ? &down : nullptr;
      torch::Tensor& sum = pending ? sums[which] : unused;
      if (layer.qkv.fuses_rows(x)) {
        const specjet_cpu::RowOp norm = specjet_cpu::rms_norm_op(x, layer.norm1, layer.eps1, residual, sum, h);
        specjet_cpu::fit_output(qkv, {tokens, layer.qkv.out_columns()}, x.options());
        const specjet_cpu::RowOp rope = specjet_cpu::rope_store_op(qkv, cos, sin, k, v, slots, num_heads_, q);
        layer.qkv.fused_into(h, qkv, {&norm, &rope});
      } else {
        specjet_cpu::rms_norm_into(x, layer.norm1, layer.eps1, residual, sum, h);
        layer.qkv.into(h, qkv);
        specjet_cpu::rope_store_into(qkv, cos, sin, k, v, slots, num_heads_, q);
      }
      if (pending) {
        x = sums[which];
        which ^= 1;
      }
      specjet_cpu::paged_attention_into(q, k, v, kv_indices, kv_lens, q_lens, q_starts, mask, scale_, attention_isa,
                                        attended);
      if (!flat.defined() || !flat.is_alias_of(attended)) flat = attended.view({tokens, num_heads_ * head_dim_});
      layer.o.into(flat, o);
      if (layer.gate_up.fuses_rows(x)) {  // x + o, its norm, in gate|up's team
        const specjet_cpu::RowOp norm = specjet_cpu::rms_norm_op(x, layer.norm2, layer.eps2, &o, sums[which], h);
        layer.gate_up.fused_into(h, gate_up, {&norm, nullptr});
      } else {
        specjet_cpu::rms_norm_into(x, layer.norm2, layer.eps2, &o, sums[which], h);
        layer.gate_up.into(h, gate_up);
      }
      x = sums[which];
      which ^= 1;
      if (layer.down.fuses_rows(gate_up)) {  // SiLU(gate) * up in down's team
        const specjet_cpu::RowOp silu = specjet_cpu::silu_mul_op(gate_up, act);
        layer.down.fused_into(act, down, {&silu, nullptr});
      } else {
        specjet_cpu::silu_mul_into(gate_up, act);
        layer.down.into(act, down);
      }
      pending = true;
      if (next < capture.size() && capture[next] == l) {
        x = x + down;  // a tensor of its own: the run's sums are written again
        pending = false;
        taken.push_back(x);
        ++next;
      }
    }
    if (pending) x = x + down;
    return {x, taken};
  }

  // A decode step's or a verify's forward from host lists, then the final norm. Request b (table row rows[b]) brings
  // q_lens[b] new tokens, the last of its kv_lens[b] positions, which it sees all of (under `mask` among its new
  // tokens, [B, >= max_q, >= max_q] bool, where given); token i of the flat list (requests in order) is ids[i] at
  // RoPE position positions[i] and writes its KV to slot table[its request's row, slot_cols[i]]. The inputs are the
  // values models/llama.py's forward builds from ForwardBatch.from_host and host_token_tensors (embedding rows, RoPE
  // table rows, slots, the attention's metadata), so the result has that forward's bits: the normed rows the LM head
  // reads, [T, hidden], and the outputs of the layers in `capture`. What goes is a dozen small torch ops and their
  // Python, each costing more than its work on a step. Everything is checked before anything is written.
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward_lists(
      const std::vector<int64_t>& ids, const std::vector<int64_t>& positions, const std::vector<int64_t>& slot_cols,
      const std::vector<int64_t>& rows, const std::vector<int64_t>& q_lens, const std::vector<int64_t>& kv_lens,
      const torch::Tensor& table, const torch::Tensor& embed, const torch::Tensor& cos_table,
      const torch::Tensor& sin_table, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
      const c10::optional<torch::Tensor>& mask, const torch::Tensor& norm, double eps, int64_t attention_isa,
      const std::vector<int64_t>& capture) const {
    TORCH_CHECK(!ids.empty() && positions.size() == ids.size() && slot_cols.size() == ids.size(),
                "layer stack lists: ids, positions and slot_cols must be non-empty lists of one length");
    TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() && embed.device().is_cpu(),
                "layer stack lists: the embedding must be a contiguous CPU [vocab, hidden] tensor");
    const Lists lists = check_lists(positions, slot_cols, rows, q_lens, kv_lens, table, cos_table, sin_table, mask);
    const int64_t vocab = embed.size(0);
    for (int64_t id : ids) TORCH_CHECK(id >= 0 && id < vocab, "layer stack lists: token id ", id, " outside [0, ", vocab, ")");
    return run_lists(rows_of(embed, ids), lists, positions, slot_cols, rows, q_lens, kv_lens, table, cos_table,
                     sin_table, k_cache, v_cache, mask, norm, eps, attention_isa, capture, 0);
  }

  // forward_lists with the input rows given ([T, hidden], contiguous) instead of token ids: a draft's block, whose
  // rows are its own (csrc/dflash_block.cpp). The output leaves out the first `skip` rows of each request (a block's
  // root, which drafts nothing): the final norm is per row, so the rows it gives are the rows of the whole output.
  torch::Tensor forward_rows(const torch::Tensor& x, const std::vector<int64_t>& positions,
                             const std::vector<int64_t>& slot_cols, const std::vector<int64_t>& rows,
                             const std::vector<int64_t>& q_lens, const std::vector<int64_t>& kv_lens,
                             const torch::Tensor& table, const torch::Tensor& cos_table, const torch::Tensor& sin_table,
                             const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const c10::optional<torch::Tensor>& mask, const torch::Tensor& norm, double eps,
                             int64_t attention_isa, int64_t skip) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                    x.size(0) == static_cast<int64_t>(positions.size()) && slot_cols.size() == positions.size() &&
                    !positions.empty(),
                "layer stack rows: x must be contiguous CPU [T, hidden], positions and slot_cols T long");
    const Lists lists = check_lists(positions, slot_cols, rows, q_lens, kv_lens, table, cos_table, sin_table, mask);
    TORCH_CHECK(skip >= 0, "layer stack rows: skip must be >= 0");
    for (int64_t q : q_lens) TORCH_CHECK(q > skip, "layer stack rows: every request must keep a row after skipping ", skip);
    return std::get<0>(run_lists(x, lists, positions, slot_cols, rows, q_lens, kv_lens, table, cos_table, sin_table,
                                 k_cache, v_cache, mask, norm, eps, attention_isa, {}, skip));
  }

 private:
  struct Lists {
    int64_t max_q = 0, max_kv = 0;
  };

  // The checks of forward_lists' request lists (every one before anything is written).
  static Lists check_lists(const std::vector<int64_t>& positions, const std::vector<int64_t>& slot_cols,
                           const std::vector<int64_t>& rows, const std::vector<int64_t>& q_lens,
                           const std::vector<int64_t>& kv_lens, const torch::Tensor& table,
                           const torch::Tensor& cos_table, const torch::Tensor& sin_table,
                           const c10::optional<torch::Tensor>& mask) {
    const int64_t tokens = static_cast<int64_t>(positions.size()), batch = static_cast<int64_t>(rows.size());
    TORCH_CHECK(batch > 0 && q_lens.size() == rows.size() && kv_lens.size() == rows.size(),
                "layer stack lists: rows, q_lens and kv_lens must be non-empty lists of one length");
    TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kInt64 && table.is_contiguous() && table.device().is_cpu(),
                "layer stack lists: the request-to-token table must be a contiguous CPU int64 [rows, positions] tensor");
    TORCH_CHECK(cos_table.dim() == 2 && cos_table.is_contiguous() && sin_table.sizes().equals(cos_table.sizes()) &&
                    sin_table.is_contiguous() && sin_table.scalar_type() == cos_table.scalar_type(),
                "layer stack lists: the RoPE tables must be contiguous [positions, D/2] tensors of one dtype");
    const int64_t width = table.size(1), table_rows = table.size(0), rope_rows = cos_table.size(0);
    Lists lists;
    int64_t total = 0;
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(rows[b] >= 0 && rows[b] < table_rows, "layer stack lists: table row ", rows[b], " outside [0, ",
                  table_rows, ")");
      TORCH_CHECK(q_lens[b] >= 1 && q_lens[b] <= kv_lens[b] && kv_lens[b] <= width, "layer stack lists: request ", b,
                  " has q_len ", q_lens[b], " and kv_len ", kv_lens[b], " (a table row holds ", width, ")");
      lists.max_q = std::max(lists.max_q, q_lens[b]);
      lists.max_kv = std::max(lists.max_kv, kv_lens[b]);
      total += q_lens[b];
    }
    TORCH_CHECK(total == tokens, "layer stack lists: the requests bring ", total, " tokens, the lists hold ", tokens);
    for (int64_t i = 0; i < tokens; ++i) {
      TORCH_CHECK(positions[i] >= 0 && positions[i] < rope_rows, "layer stack lists: position ", positions[i],
                  " outside the RoPE table (", rope_rows, ")");
      TORCH_CHECK(slot_cols[i] >= 0 && slot_cols[i] < width, "layer stack lists: slot column ", slot_cols[i],
                  " outside the table (", width, ")");
    }
    if (mask) {
      TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous() && mask->dim() == 3 &&
                      mask->size(0) == batch && mask->size(1) == mask->size(2) && mask->size(1) >= lists.max_q,
                  "layer stack lists: the mask must be contiguous bool [B, >= max_q, >= max_q]");
    }
    return lists;
  }

  // The rows index[i] of a contiguous [rows, width] tensor, stacked.
  // x (checked lists' rows) through the layers and the final norm, the first `skip` rows of each request left out.
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> run_lists(
      const torch::Tensor& x, const Lists& lists, const std::vector<int64_t>& positions,
      const std::vector<int64_t>& slot_cols, const std::vector<int64_t>& rows, const std::vector<int64_t>& q_lens,
      const std::vector<int64_t>& kv_lens, const torch::Tensor& table, const torch::Tensor& cos_table,
      const torch::Tensor& sin_table, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
      const c10::optional<torch::Tensor>& mask, const torch::Tensor& norm, double eps, int64_t attention_isa,
      const std::vector<int64_t>& capture, int64_t skip) const {
    const int64_t tokens = x.size(0), batch = static_cast<int64_t>(rows.size());
    const int64_t width = table.size(1), max_kv = lists.max_kv;
    torch::Tensor cos = rows_of(cos_table, positions), sin = rows_of(sin_table, positions);
    const auto longs = torch::TensorOptions().dtype(torch::kInt64);
    torch::Tensor slots = torch::empty({tokens}, longs), kv_len_t = torch::empty({batch}, longs);
    torch::Tensor q_len_t = torch::empty({batch}, longs), q_starts = torch::empty({batch}, longs);
    torch::Tensor kv_indices = torch::zeros({batch, max_kv}, longs);  // past a row's length: slot 0 (padding)
    const int64_t* t = table.data_ptr<int64_t>();
    int64_t *slot = slots.data_ptr<int64_t>(), *kv = kv_indices.data_ptr<int64_t>();
    std::memcpy(kv_len_t.data_ptr<int64_t>(), kv_lens.data(), batch * sizeof(int64_t));
    std::memcpy(q_len_t.data_ptr<int64_t>(), q_lens.data(), batch * sizeof(int64_t));
    int64_t* q_start = q_starts.data_ptr<int64_t>();
    for (int64_t b = 0, i = 0; b < batch; ++b) {
      const int64_t* row = t + rows[b] * width;
      q_start[b] = i;
      std::memcpy(kv + b * max_kv, row, kv_lens[b] * sizeof(int64_t));
      for (int64_t j = 0; j < q_lens[b]; ++j, ++i) slot[i] = row[slot_cols[i]];
    }
    auto [out, taken] = run(x, cos, sin, k_cache, v_cache, slots, kv_indices, kv_len_t, q_len_t, q_starts, mask,
                            attention_isa, capture);
    if (skip > 0) {
      std::vector<int64_t> kept;
      kept.reserve(tokens - skip * batch);
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t j = skip; j < q_lens[b]; ++j) kept.push_back(q_start[b] + j);
      }
      out = rows_of(out, kept);
    }
    torch::Tensor normed, unused;
    specjet_cpu::rms_norm_into(out, norm, eps, nullptr, unused, normed);
    return {normed, taken};
  }

  int64_t num_heads_, head_dim_;
  double scale_;
  std::vector<Layer> layers_;
};

Projection quantized_projection(int64_t kind, torch::Tensor a, torch::Tensor b, torch::Tensor c, int64_t n,
                                int64_t group, c10::optional<torch::Tensor> bias, int64_t isa) {
  TORCH_CHECK(kind == kQ41 || kind == kInt8, "layer stack: unknown quantized kind ", kind);
  TORCH_CHECK(specjet_cpu::qgemm_isa_supported(isa), "layer stack: quantized GEMM instruction set ", isa,
              " is not supported by this CPU");
  Projection p;
  p.kind = kind;
  p.a = std::move(a), p.b = std::move(b), p.c = std::move(c);
  p.n = n, p.group = group, p.bias = std::move(bias), p.isa = isa;
  return p;
}

Projection bf16_projection(torch::Tensor weight, c10::optional<torch::Tensor> bias, int64_t isa) {
  TORCH_CHECK(specjet_cpu::bf16_gemm_isa_supported(isa), "layer stack: bf16 GEMM instruction set ", isa,
              " is not supported by this CPU");
  Projection p;
  p.kind = kBf16;
  p.a = std::move(weight), p.bias = std::move(bias), p.isa = isa;
  return p;
}

Projection bf16x3_projection(torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(specjet_cpu::bf16_gemm_isa_supported(2), "layer stack: a bf16x3 projection needs AMX tiles");
  Projection p;
  p.kind = kBf16x3;
  p.a = std::move(weight), p.bias = std::move(bias);
  return p;
}

Projection fp32_projection(torch::Tensor weight, c10::optional<torch::Tensor> bias, int64_t isa) {
  TORCH_CHECK(specjet_cpu::fp32_gemm_isa_supported(isa), "layer stack: float32 GEMM instruction set ", isa,
              " is not supported by this CPU");
  Projection p;
  p.kind = kFp32;
  p.a = std::move(weight), p.bias = std::move(bias), p.isa = isa;
  return p;
}

Projection float_projection(torch::Tensor weight, c10::optional<torch::Tensor> bias, bool blocked, int64_t min_rows,
                            int64_t max_rows) {
  TORCH_CHECK(min_rows >= 1 && max_rows >= min_rows, "layer stack: bad row plan ", min_rows, "..", max_rows);
  Projection p;
  if (blocked) onednn_linear_op();  // throws here if this torch's op is not the one called
  p.kind = blocked ? kOneDnn : kDense;
  p.a = std::move(weight), p.bias = std::move(bias), p.min_rows = min_rows, p.max_rows = max_rows;
  return p;
}

}  // namespace

namespace specjet_cpu {

void register_layer_stack(pybind11::module& module) {
  pybind11::class_<Projection>(module, "StackProjection");
  module.def("quantized_projection", &quantized_projection,
             "a packed Q4_1 (kind 0: qs, d, m) or int8 (kind 1: q, s, wsum) weight of n columns");
  module.def("bf16_projection", &bf16_projection, "a packed bf16 weight (kernels/bf16_gemm.py) on instruction set isa");
  module.def("bf16x3_projection", &bf16x3_projection,
             "a float weight as three bf16 tile products (kernels/bf16_gemm.py's Bf16x3Linear; AMX)");
  module.def("fp32_projection", &fp32_projection,
             "a packed float32 weight (kernels/fp32_gemm.py's Fp32Linear) on instruction set isa");
  module.def("float_projection", &float_projection,
             "a float weight: oneDNN-blocked (blocked) or weight_t, run in chunks of min_rows..max_rows rows");
  pybind11::class_<LayerStack>(module, "LayerStack")
      .def(pybind11::init<int64_t, int64_t, double>())
      .def("add_layer", &LayerStack::add_layer)
      .def("__len__", &LayerStack::size)
      // The call keeps the GIL (module.cpp says why).
      .def("run", &LayerStack::run)
      .def("forward_lists", &LayerStack::forward_lists)
      .def("forward_rows", &LayerStack::forward_rows);
}

}  // namespace specjet_cpu
