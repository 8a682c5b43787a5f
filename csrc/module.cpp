// The Python module of specjet's C++ CPU ops (specjet.kernels._cpu_ops): the batch-invariant paged
// attention, the per-row parts of a layer, the quantized GEMM and the layer stack that chains them.
#include "cost_shares.h"
#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using namespace specjet_cpu;
  module.doc() = "specjet's batch-invariant CPU ops: paged attention, layer ops, quantized GEMM, the layer stack";
  module.def("isa_supported", &attention_isa_supported,
             "whether this CPU runs the attention's instruction set (0 base, 1 AVX2, 2 AVX-512, 3 AMX scores, 4 bf16 "
             "products: AVX-512 BF16 whose VDPBF16PS adds a word's products in the order Intel defines)");
  module.def("bf16dp_tile_products", &bf16dp_tile_products, py::arg("mode") = -1,
             "how the bf16dp build computes a tile's products: 1 two FMAs a VDPBF16PS (the same bits; the default on "
             "Intel's cores), 0 the instruction; mode -1 asks, 0 / 1 sets; returns the mode before the call");
  module.def("dpbf16_words", &dpbf16_words,
             "acc + hi_a * hi_b + lo_a * lo_b per lane by one VDPBF16PS a 16 lanes (bf16 factors given as float32)");
  // The kernels keep the GIL while they compute. Letting it go lets the overlap loop's host thread run
  // its Python beside them, but on a CPU whose cores the kernels' threads all use, that thread then takes
  // a core from a kernel thread, and every thread of the parallel region waits for the slowed one:
  // measured slower end to end (bench/RESULTS.md, sessions 11 and 19), so the host's short work runs
  // between forwards instead.
  module.def("paged_attention", &paged_attention, "out = softmax(q K^T * scale) V over each token's visible keys");
  module.def("cost_share_starts", &cost_share_starts,
             "the attention's split of units among threads: the first unit of each of `shares` runs of about "
             "equal cost (cost_end: the units' cumulative costs), then the unit count");
  module.def("rms_norm", &rms_norm, "[x + residual,] weight * x / rms(x) per row");
  module.def("rope_store", &rope_store, "rotate q and k (neox RoPE), write k and v into the pool; returns q");
  module.def("silu_mul", &silu_mul, "silu(gate) * up per row");
  module.def("qgemm_isa_supported", &qgemm_isa_supported,
             "whether this CPU runs the quantized GEMM's instruction set (0 scalar, 1 AVX2, 2 AVX-512 VNNI, 3 AVX-512 VNNI + AMX tiles)");
  module.def("q4_1_wide_tiles", &q4_1_wide_tiles,
             "whether the AVX-512 Q4_1 kernel runs calls of 12+ rows in 3-group x 4-row tiles (chosen by CPU)");
  module.def("set_q4_1_wide_tiles", &set_q4_1_wide_tiles,
             "-1: the CPU's choice, 0: one-group tiles, 1: 3-group tiles; returns the setting replaced");
  module.def("team_runs", &team_runs,
             "how many quantized or bf16 GEMM calls so far ran on one team of two threads or more (cpu_ops.h run_team)");
  module.def("q4_1_gemm", &q4_1_gemm, "y = x @ W^T (+ bias) for a packed Q4_1 weight of N columns");
  module.def("int8_gemm", &int8_gemm, "y = x @ W^T (+ bias) for a packed int8 weight of N columns");
  module.def("int8_gemm_masked", &int8_gemm_masked,
             "int8_gemm's y where a row's grammar bitmask allows few columns: those alone, -inf elsewhere");
  module.def("fp32_gemm_isa_supported", &fp32_gemm_isa_supported,
             "whether this CPU runs the float32 GEMM's instruction set (1 AVX2 + FMA, 2 AVX-512F; the same bits)");
  module.def("fp32_gemm", &fp32_gemm,
             "y = x @ W (+ bias) for float32 x and a packed float32 weight [N / 16, K, 16]: one FMA chain an output");
  module.def("fp32_gemm_masked", &fp32_gemm_masked,
             "fp32_gemm's logits of grammar-masked rows: a row allowing at most max_allowed columns gets those alone "
             "(the bits fp32_gemm gives them), -inf elsewhere; the other rows fp32_gemm's");
  module.def("bf16_gemm_isa_supported", &bf16_gemm_isa_supported,
             "whether this CPU runs the bf16 GEMM's instruction set (1 AVX-512 BF16, 2 AMX tiles)");
  module.def("bf16_gemm", &bf16_gemm, "y = x @ W (+ bias) for bf16 x and a packed bf16 weight, rounded to bf16");
  module.def("bf16x3_gemm", &bf16x3_gemm,
             "y = x @ W (+ bias) for float32 x and a Bf16x3Linear weight: three bf16 tile products, float32 out (AMX)");
  module.def("bf16_gemm_masked", &bf16_gemm_masked,
             "bf16_gemm's float32 logits of grammar-masked rows: a row allowing at most max_allowed columns gets "
             "those alone (the bits bf16_gemm gives them), -inf elsewhere; the other rows bf16_gemm's");
  module.def("masked_topk_logp", &masked_topk_logp,
             "per row: the k best columns the row's token bitmask allows (all without one), log-probs over them");
  module.def("masked_topk_row", &masked_topk_row,
             "masked_topk_logp of one row as host values: ([(token, log-prob)] best first, allowed count)");
  module.def("masked_argmax", &masked_argmax,
             "per row: torch.argmax of the row with the columns its token bitmask forbids at -inf (masked rows only)");
  module.def("argmax_rows", &argmax_rows,
             "per row: torch.argmax of the row (the first maximal value, the first NaN where there is one), one "
             "vectorised pass a row, rows split between threads where they are many");
  module.def("argmax_candidates", &argmax_candidates, py::arg("x"), py::arg("approx"), py::arg("factors"),
             py::arg("allowed") = py::none(), py::arg("allowed_rows") = py::none(), py::arg("bf16_ties") = false,
             "per row: the token bitmask of the columns whose bound around the int8 copy's value reaches the largest "
             "lower end among the allowed columns (those that can hold the head's argmax; bf16_ties: also those "
             "that may round to the same bf16 value as it)");
  module.def("head_cross_entropy_rows", &head_cross_entropy_rows,
             "per row of LM-head logits: (cross-entropy against the target column, argmax), writing the logits' "
             "gradient (softmax - one-hot) * the row's share into grad; one widening, one exponential a column; "
             "with teacher logits the label mixes in distill * the teacher's softmax",
             py::arg("logits"), py::arg("targets"), py::arg("share"), py::arg("grad"), py::arg("teacher") = py::none(),
             py::arg("distill") = 0.0);
  module.def("sample_rows_lists", &sample_rows_lists,
             "per row: a token drawn from softmax(logits / T) under top-k, top-p and min-p by the row's uniform, "
             "or the argmax where T <= 0; the parameters as host lists (no tensors to build a step), the rows "
             "flagged in masked read through their token bitmask (forbidden columns at -inf)");
  module.def("apply_token_bitmask_rows", &apply_token_bitmask_rows,
             "xgrammar's apply_token_bitmask_inplace for CPU float32 logits and the given rows: the columns a row's "
             "bitmask forbids at -inf, in place (a word of the mask at a time)");
  module.def("verify_tree_sample", &verify_tree_sample,
             "per sampled request: its draft tree's accepted path (-1 padded), the path's length and the bonus token, "
             "each node's token drawn as sample_rows_lists draws (the coin of its depth) and followed to the child "
             "holding it; the rows flagged in masked read through their token bitmask",
             py::arg("logits"), py::arg("offsets"), py::arg("sizes"), py::arg("tokens"), py::arg("parents"),
             py::arg("uniforms"), py::arg("temperatures"), py::arg("top_ks"), py::arg("top_ps"), py::arg("min_ps"),
             py::arg("bitmask") = py::none(), py::arg("masked") = std::vector<bool>());
  module.def("pin_team_threads", &pin_team_threads,
             "bind thread t of the calling thread's OpenMP team to cpus[t % len(cpus)]; returns each thread's CPU "
             "(-1 where the binding failed)");
  register_layer_stack(module);
  register_dflash_block(module);
}
