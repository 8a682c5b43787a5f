// A DFlash draft's block input in one call (models/dflash.py's DFlashDraftModel.block_input, inference): each block
// is its root, the tokens known to follow it (a grammar's forced text), then mask rows. Row i of block b is
//   base + root_proj(c_b)           base: the mask embedding of row i, or zero where the row holds a token
//   (+ embedding of its token)      the root (row 0) and the known tokens (rows 1..n)
//   (+ prev_proj(embedding of the token at row i - 1))   where row i - 1 holds a token
// with the additions in that order, each rounded to the rows' dtype as torch's elementwise add rounds it, and the
// projections by their kernels (csrc/stack_projection.h), so the rows have the bits of the torch ops it replaces
// (a dozen of them a block, each costing more than its work at this size).
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "stack_projection.h"

namespace {

// Row `from` of a [rows, h] tensor as floats.
void load_row(const torch::Tensor& t, int64_t from, float* out) {
  const int64_t h = t.size(1);
  if (t.scalar_type() == torch::kFloat32) {
    std::memcpy(out, t.data_ptr<float>() + from * h, h * sizeof(float));
  } else {
    const c10::BFloat16* src = t.data_ptr<c10::BFloat16>() + from * h;
    for (int64_t j = 0; j < h; ++j) out[j] = static_cast<float>(src[j]);
  }
}

// v rounded to the rows' dtype and back (bf16: round to nearest even, as torch's conversion).
template <typename T>
void round_to(float* v, int64_t h) {
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t j = 0; j < h; ++j) v[j] = static_cast<float>(static_cast<T>(v[j]));
  }
}

template <typename T>
torch::Tensor assemble(const std::vector<int64_t>& lens, int64_t size, const torch::Tensor& mask_rows,
                       const torch::Tensor* root_add, const torch::Tensor* prev_add, const torch::Tensor& embedded) {
  const int64_t batch = static_cast<int64_t>(lens.size()), h = mask_rows.size(1);
  torch::Tensor x = torch::empty({batch * size, h}, mask_rows.options());
  T* out = x.data_ptr<T>();
  std::vector<float> row(h), term(h);
  for (int64_t b = 0, token = 0, prev = 0; b < batch; ++b) {
    const int64_t n = lens[b];
    for (int64_t i = 0; i < size; ++i) {
      const bool holds_token = i <= n;
      if (holds_token) std::fill(row.begin(), row.end(), 0.0f);
      else load_row(mask_rows, i, row.data());
      if (root_add) {  // (base + r): one add, rounded
        load_row(*root_add, b, term.data());
        for (int64_t j = 0; j < h; ++j) row[j] += term[j];
        round_to<T>(row.data(), h);
      }
      if (holds_token) {
        load_row(embedded, token++, term.data());
        for (int64_t j = 0; j < h; ++j) row[j] += term[j];
        round_to<T>(row.data(), h);
      }
      if (prev_add && i >= 1 && i - 1 <= n) {  // the token before this row, projected
        load_row(*prev_add, prev++, term.data());
        for (int64_t j = 0; j < h; ++j) row[j] += term[j];
        round_to<T>(row.data(), h);
      }
      T* dst = out + (b * size + i) * h;
      for (int64_t j = 0; j < h; ++j) dst[j] = static_cast<T>(row[j]);
    }
  }
  return x;
}

}  // namespace

namespace specjet_cpu {

// Blocks of `size` rows for roots[b] and known[b] (tokens after the root, at most size - 1 used) -> [B * size, h]
// in mask_rows' dtype. mask_rows [size, h]: the mask embedding of each block row (row 0's is never read). With
// root_proj, root_ctx [B, h] (the rows' dtype) is each block's last verified context; with prev_proj each row after
// a token reads that token's embedding through it. Embeddings are rows of `embed` converted to the rows' dtype.
torch::Tensor dflash_block_input(const std::vector<int64_t>& roots, const std::vector<std::vector<int64_t>>& known,
                                 int64_t size, const torch::Tensor& embed, const torch::Tensor& mask_rows,
                                 const c10::optional<Projection>& root_proj, const c10::optional<torch::Tensor>& root_ctx,
                                 const c10::optional<Projection>& prev_proj) {
  const int64_t batch = static_cast<int64_t>(roots.size());
  TORCH_CHECK(batch > 0 && size >= 2, "dflash block: need at least one block of at least 2 rows");
  TORCH_CHECK(known.empty() || static_cast<int64_t>(known.size()) == batch,
              "dflash block: known must list every block's tokens (or none)");
  TORCH_CHECK(mask_rows.dim() == 2 && mask_rows.size(0) == size && mask_rows.is_contiguous() &&
                  mask_rows.device().is_cpu() &&
                  (mask_rows.scalar_type() == torch::kFloat32 || mask_rows.scalar_type() == torch::kBFloat16),
              "dflash block: mask_rows must be contiguous CPU float32 or bfloat16 [size, h]");
  const int64_t h = mask_rows.size(1);
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == h && embed.is_contiguous() && embed.device().is_cpu() &&
                  (embed.scalar_type() == torch::kFloat32 || embed.scalar_type() == torch::kBFloat16),
              "dflash block: the embedding must be contiguous CPU float32 or bfloat16 [vocab, ", h, "]");
  TORCH_CHECK(root_proj.has_value() == root_ctx.has_value(), "dflash block: root_proj and root_ctx come together");
  if (root_ctx) {
    TORCH_CHECK(root_ctx->dim() == 2 && root_ctx->size(0) == batch && root_ctx->size(1) == h &&
                    root_ctx->is_contiguous() && root_ctx->scalar_type() == mask_rows.scalar_type(),
                "dflash block: root_ctx must be contiguous [B, ", h, "] in the rows' dtype");
  }
  const int64_t vocab = embed.size(0);
  std::vector<int64_t> lens(batch), tokens, prev_tokens;
  for (int64_t b = 0; b < batch; ++b) {
    lens[b] = known.empty() ? 0 : std::min<int64_t>(static_cast<int64_t>(known[b].size()), size - 1);
    for (int64_t i = 0; i <= lens[b]; ++i) {
      const int64_t t = i == 0 ? roots[b] : known[b][i - 1];
      TORCH_CHECK(t >= 0 && t < vocab, "dflash block: token id ", t, " outside [0, ", vocab, ")");
      tokens.push_back(t);
      if (i < size - 1) prev_tokens.push_back(static_cast<int64_t>(tokens.size()) - 1);  // a row follows it
    }
  }
  // The tokens' embeddings in the rows' dtype (F.embedding(...).to(dtype)).
  const torch::Tensor embedded = rows_of(embed, tokens).to(mask_rows.scalar_type());
  c10::optional<torch::Tensor> root_add, prev_add;
  if (root_proj) root_add = (*root_proj)(*root_ctx).to(mask_rows.scalar_type()).contiguous();
  if (prev_proj) {  // a token in a block's last row has no row after it
    const torch::Tensor rows = prev_tokens.size() == tokens.size() ? embedded : rows_of(embedded, prev_tokens);
    prev_add = (*prev_proj)(rows).to(mask_rows.scalar_type()).contiguous();
  }
  // assemble reads h values from each row of these: a projection of another width would be read past its rows.
  for (const auto* add : {&root_add, &prev_add})
    TORCH_CHECK(!add->has_value() || ((*add)->dim() == 2 && (*add)->size(1) == h), "dflash block: root_proj and "
                "prev_proj must give ", h, " columns (the rows' width), got ", (*add)->sizes());
  const torch::Tensor* r = root_add ? &*root_add : nullptr;
  const torch::Tensor* p = prev_add ? &*prev_add : nullptr;
  if (mask_rows.scalar_type() == torch::kFloat32) {
    return assemble<float>(lens, size, mask_rows, r, p, embedded);
  }
  return assemble<c10::BFloat16>(lens, size, mask_rows, r, p, embedded);
}

void register_dflash_block(pybind11::module& module) {
  module.def("dflash_block_input", &dflash_block_input,
             "a DFlash draft's block rows [B * size, h]: per block its root, its known tokens, then mask rows, each "
             "plus root_proj(root_ctx) and prev_proj of the token before it (models/dflash.py's block_input)");
}

}  // namespace specjet_cpu
