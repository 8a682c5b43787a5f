// A projection of the C++ layer stack and of the ops around it (csrc/layer_stack.cpp, csrc/dflash_block.cpp): one of
// the inference operands of specjet/kernels, called with the kernel and the arguments its Python wrapper uses, so
// it gives that wrapper's bits. A packed Q4_1 or int8 weight (kernels/qgemm.py's QuantizedLinear, float32
// activations), a packed bf16 weight (kernels/bf16_gemm.py's Bf16Linear) or a float weight (kernels/linear.py's
// PackedLinear: oneDNN's matmul on a blocked weight, or x @ W, under its row plan), a packed float32 weight
// (kernels/fp32_gemm.py's Fp32Linear) or a float weight as three bf16 tile products (kernels/bf16_gemm.py's Bf16x3Linear: a feature extractor's). Built in Python by
// kernels/layer_stack.py's stack_projection (the StackProjection type).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_ops.h"

namespace specjet_cpu {

enum Kind : int64_t { kQ41 = 0, kInt8 = 1, kOneDnn = 2, kDense = 3, kBf16 = 4, kBf16x3 = 5, kFp32 = 6 };

// Rows index[i] of a contiguous [n, h] CPU tensor, gathered into a new one (a memcpy a row: a handful of rows of the
// tables and embeddings, where index_select's dispatch costs more than the copies).
inline torch::Tensor rows_of(const torch::Tensor& source, const std::vector<int64_t>& index) {
  const int64_t n = static_cast<int64_t>(index.size());
  torch::Tensor out = torch::empty({n, source.size(1)}, source.options());
  const int64_t bytes = source.size(1) * source.element_size();
  const auto* from = static_cast<const char*>(source.data_ptr());
  auto* to = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(to + i * bytes, from + index[i] * bytes, bytes);
  return out;
}

// The op torch.ops.mkldnn._linear_pointwise calls from Python (kernels/linear.py): the same kernel. Looked
// up (and its signature checked) when a oneDNN projection is built, so a torch whose op differs fails the
// stack's construction, where the model falls back to its Python loop, not a forward.
using OneDnnLinearFn = torch::Tensor(const torch::Tensor&, const torch::Tensor&, const std::optional<torch::Tensor>&,
                                     c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                     std::optional<c10::string_view>);
using OneDnnLinear = c10::TypedOperatorHandle<OneDnnLinearFn>;

inline const OneDnnLinear& onednn_linear_op() {
  static const OneDnnLinear op = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                                     .typed<OneDnnLinearFn>();
  return op;
}

inline torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  return onednn_linear_op().call(x, w, bias, "none", c10::List<std::optional<c10::Scalar>>(), c10::string_view(""));
}

// Hidden, as pybind11 declares its own types (the class is bound to Python in layer_stack.cpp).
struct __attribute__((visibility("hidden"))) Projection {
  int64_t kind = kDense;
  // Q4_1: qs, d, m; int8: q, s, wsum; oneDNN: the blocked weight; dense: weight_t; bf16, bf16x3, fp32: the packed
  // weight
  torch::Tensor a, b, c;
  c10::optional<torch::Tensor> bias;
  int64_t n = 0, group = 0, isa = 0, min_rows = 1, max_rows = 1;

  // PackedLinear.kernel / run_chunk: a chunk below min_rows is padded with zero rows.
  torch::Tensor float_kernel(const torch::Tensor& x) const {
    if (kind == kOneDnn) return onednn_linear(x, a, bias);
    return bias ? at::addmm(*bias, x, a) : at::matmul(x, a);
  }
  torch::Tensor float_chunk(const torch::Tensor& x) const {
    const int64_t rows = x.size(0);
    if (rows >= min_rows) return float_kernel(x);
    auto pad = x.new_zeros({min_rows - rows, x.size(1)});
    return float_kernel(at::cat({x, pad})).slice(0, 0, rows);
  }
  torch::Tensor quantized(const torch::Tensor& x) const {
    torch::Tensor y;
    quantized_into(x, y);
    return y;
  }
  void quantized_into(const torch::Tensor& x, torch::Tensor& y, const FusedRows& fused = {}) const {
    if (kind == kQ41) specjet_cpu::q4_1_gemm_into(x, a, b, c, n, bias, isa, y, fused);
    else specjet_cpu::int8_gemm_into(x, a, b, c, group, n, bias, isa, y, fused);
  }

  // x [rows, K] (a layer's activations: 2-D, contiguous) -> [rows, N] in x's dtype.
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == kBf16) {  // Bf16Linear.__call__
      if (x.scalar_type() == torch::kBFloat16) return specjet_cpu::bf16_gemm(x, a, bias, isa);
      return specjet_cpu::bf16_gemm(x.to(torch::kBFloat16).contiguous(), a, bias, isa).to(x.scalar_type());
    }
    if (kind == kBf16x3) {  // Bf16x3Linear.__call__
      if (x.scalar_type() == torch::kFloat32) return specjet_cpu::bf16x3_gemm(x, a, bias);
      return specjet_cpu::bf16x3_gemm(x.to(torch::kFloat32).contiguous(), a, bias).to(x.scalar_type());
    }
    if (kind == kFp32) {  // Fp32Linear.__call__
      if (x.scalar_type() == torch::kFloat32) return specjet_cpu::fp32_gemm(x, a, bias, isa);
      return specjet_cpu::fp32_gemm(x.to(torch::kFloat32).contiguous(), a, bias, isa).to(x.scalar_type());
    }
    if (kind == kQ41 || kind == kInt8) {  // QuantizedLinear.__call__
      if (x.scalar_type() == torch::kFloat32) return quantized(x);
      return quantized(x.to(torch::kFloat32).contiguous()).to(x.scalar_type());
    }
    const int64_t rows = x.size(0);  // PackedLinear.__call__
    if (rows <= max_rows) return float_chunk(x);
    std::vector<torch::Tensor> parts;
    for (int64_t i = 0; i < rows; i += max_rows) parts.push_back(float_chunk(x.slice(0, i, std::min(rows, i + max_rows))));
    return at::cat(parts);
  }

  // operator()(x) into y (cpu_ops.h's fit_output: y is reused when it fits) where the kernel writes in place: a
  // quantized, bf16, bf16x3 or fp32 weight on rows of its kernel's dtype. Elsewhere y becomes the tensor operator() returns.
  void into(const torch::Tensor& x, torch::Tensor& y) const {
    if (bf16_on(x)) return specjet_cpu::bf16_gemm_into(x, a, bias, isa, y);
    if (kind == kBf16x3 && x.scalar_type() == torch::kFloat32) return specjet_cpu::bf16x3_gemm_into(x, a, bias, y);
    if (fp32_on(x)) return specjet_cpu::fp32_gemm_into(x, a, bias, isa, y);
    if (quantized_on(x)) return quantized_into(x, y);
    y = (*this)(x);
  }

  // Whether the kernel of this weight takes x's rows as they are (no conversion): a quantized or float32 weight on
  // float32 rows, a bf16 weight on bf16 rows.
  bool quantized_on(const torch::Tensor& x) const {
    return (kind == kQ41 || kind == kInt8) && x.scalar_type() == torch::kFloat32;
  }
  bool bf16_on(const torch::Tensor& x) const { return kind == kBf16 && x.scalar_type() == torch::kBFloat16; }
  bool fp32_on(const torch::Tensor& x) const { return kind == kFp32 && x.scalar_type() == torch::kFloat32; }

  // Whether fused_into runs row ops in this projection's kernel team: where its kernel takes the rows as they are.
  bool fuses_rows(const torch::Tensor& x) const { return quantized_on(x) || bf16_on(x) || fp32_on(x); }

  // into(x, y) with `fused` row ops (cpu_ops.h) around it in the kernel's team, where fuses_rows(x): x [rows, K]
  // already shaped (`before` writes it), y already [rows, out_columns()] of x's dtype (`after` reads it: the kernel
  // keeps y, so the op's pointers into it hold).
  void fused_into(const torch::Tensor& x, torch::Tensor& y, const FusedRows& fused) const {
    TORCH_CHECK(fuses_rows(x), "layer stack: fused row ops need a quantized or float32 weight on float32 rows or bf16 "
                "on bf16");
    TORCH_CHECK(!fused.after || (y.defined() && y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == out_columns() &&
                                 y.scalar_type() == x.scalar_type() && y.is_contiguous()),
                "layer stack: a fused op after the projection needs its output sized beforehand");
    if (kind == kBf16) specjet_cpu::bf16_gemm_into(x, a, bias, isa, y, fused);
    else if (kind == kFp32) specjet_cpu::fp32_gemm_into(x, a, bias, isa, y, fused);
    else quantized_into(x, y, fused);
  }

  // The columns the kernel writes: n, or a bf16 weight's whole 16-column groups.
  int64_t out_columns() const { return kind == kBf16 || kind == kFp32 ? a.size(0) * 16 : n; }
};

}  // namespace specjet_cpu
