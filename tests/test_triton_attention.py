"""The Triton paged-attention kernel against the torch reference, and the reference against a
naive per-token loop (an oracle that shares no code with either).

The kernel runs compiled on a CUDA GPU when one is present, else under Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors. The
interpreter flag is read when a kernel is decorated, i.e. when the kernel module is first
imported, and another test may already have imported triton in this process; so the kernel
checks run once in a subprocess of this very file (``--kernel-worker``) with the flag set, and
report one error figure per case back as JSON.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from triton_interpreter import interpreted, report_cases, run_kernel_worker, to_kernel_device
import torch

from specjet.kernels.attention import paged_attention_reference
from specjet.kernels.attention_metadata import build_attention_metadata



@dataclass
class Case:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lens: list[int]
    q_lens: list[int]
    page_size: int = 1
    dtype: torch.dtype = torch.float32
    # Per request, the parent of each new token (-1 = root, i.e. sees only the prefix and
    # itself). None = causal among the new tokens.
    tree_parents: list[list[int]] | None = None
    strided_q: bool = False  # q as a slice of a fused qkv tensor, like a real projection output
    seed: int = 0


CASES = {
    # Decode: one new token per request, ragged contexts (one spans three 64-position KV blocks),
    # a head_dim that is not a power of two.
    "decode_ragged": Case(4, 4, 48, kv_lens=[1, 9, 40, 150], q_lens=[1, 1, 1, 1]),
    # Decode with equal lengths: the reference runs without any mask here.
    "decode_equal_gqa": Case(9, 3, 64, kv_lens=[37, 37], q_lens=[1, 1], page_size=4),
    # Extend after a cached prefix with mixed q lengths, including a prefill with no prefix and a
    # request whose rows span two query blocks.
    "extend_mixed": Case(4, 2, 32, kv_lens=[12, 5, 90, 30], q_lens=[4, 5, 40, 1], page_size=4),
    # Tree verification: each node sees the prefix and its ancestors; the second request has
    # fewer nodes, so its mask rows are padded.
    "tree_verify": Case(
        4, 2, 32, kv_lens=[20, 7], q_lens=[7, 4], page_size=2,
        tree_parents=[[-1, 0, 0, 1, 1, 2, 4], [-1, 0, 0, 2]],
    ),
    # SmolLM2-like GQA (9 query heads on 3 KV heads, head_dim 64), pages of 16, strided q.
    "gqa_smollm2_extend": Case(9, 3, 64, kv_lens=[50, 25], q_lens=[3, 25], page_size=16, strided_q=True),
    # Half precisions, with contexts spanning several KV blocks.
    "tree_verify_fp16_gqa": Case(
        9, 3, 64, kv_lens=[140, 6], q_lens=[6, 3], page_size=4, dtype=torch.float16,
        tree_parents=[[-1, 0, 1, 1, 0, 4], [-1, 0, 0]],
    ),
    "extend_bf16": Case(6, 2, 32, kv_lens=[150, 10], q_lens=[10, 2], page_size=8, dtype=torch.bfloat16),
}

# Queries larger than keys make the softmax peaked, so a KV block that raises a row's running max
# changes the result a lot: a slip in the online-softmax rescaling cannot hide.
Q_STD = 3.0

# (atol, rtol). Kernel vs reference: fp32 differs only by summation order; half precisions by a
# few output ulps, from rounding the softmax probabilities before P @ V (the kernel) versus inside
# SDPA (the reference).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def tolerance_ratio(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """Worst |actual - expected| / (atol + rtol * |expected|): at most 1 means within tolerance."""
    atol, rtol = TOLERANCE[dtype]
    expected = expected.double()
    return ((actual.double() - expected).abs() / (atol + rtol * expected.abs())).max().item()


def build_inputs(case: Case) -> dict:
    """Random q/K/V in a paged pool, a request-to-token table with shuffled pages, and metadata."""
    gen = torch.Generator().manual_seed(case.seed)
    batch = len(case.kv_lens)
    page = case.page_size
    pages_per_req = [math.ceil(n / page) for n in case.kv_lens]
    # Page 0 stays unused: the metadata pads with slot 0, so real data never lives there.
    num_pages = sum(pages_per_req) + 3
    shuffled = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    max_context = max(case.kv_lens) + 5
    num_rows = batch + 2
    req_to_token = torch.zeros(num_rows, max_context, dtype=torch.int32)
    # Requests sit in non-identity rows of the table, as in a live pool.
    req_pool_indices = torch.randperm(num_rows, generator=gen)[:batch]
    for b, kv_len in enumerate(case.kv_lens):
        own_pages = [shuffled.pop() for _ in range(pages_per_req[b])]
        for p in range(kv_len):
            req_to_token[req_pool_indices[b], p] = own_pages[p // page] * page + p % page

    num_slots = num_pages * page
    k_cache = torch.randn(num_slots, case.num_kv_heads, case.head_dim, generator=gen).to(case.dtype)
    v_cache = torch.randn(num_slots, case.num_kv_heads, case.head_dim, generator=gen).to(case.dtype)
    num_tokens = sum(case.q_lens)
    if case.strided_q:
        qkv_width = case.num_heads + 2 * case.num_kv_heads
        qkv = Q_STD * torch.randn(num_tokens, qkv_width, case.head_dim, generator=gen)
        qkv = qkv.to(case.dtype)
        q = qkv[:, : case.num_heads]
        assert not q.is_contiguous()
    else:
        q = Q_STD * torch.randn(num_tokens, case.num_heads, case.head_dim, generator=gen)
        q = q.to(case.dtype)

    custom_mask = None
    if case.tree_parents is not None:
        max_q = max(case.q_lens)
        custom_mask = torch.zeros(batch, max_q, max_q, dtype=torch.bool)
        for b, parents in enumerate(case.tree_parents):
            assert len(parents) == case.q_lens[b]
            for node in range(len(parents)):
                ancestor = node
                while ancestor != -1:
                    custom_mask[b, node, ancestor] = True
                    ancestor = parents[ancestor]

    meta = build_attention_metadata(
        req_to_token, req_pool_indices, case.kv_lens, case.q_lens, custom_mask=custom_mask
    )
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, meta=meta, scale=case.head_dim**-0.5,
        req_to_token=req_to_token, req_pool_indices=req_pool_indices, custom_mask=custom_mask,
    )


def naive_attention(case: Case, inputs: dict) -> torch.Tensor:
    """Token by token in float64, reading slots straight from the request-to-token table."""
    q, k_cache, v_cache = (inputs[n].double() for n in ("q", "k_cache", "v_cache"))
    group = case.num_heads // case.num_kv_heads
    out = torch.empty_like(q)
    token = 0
    for b, (kv_len, q_len) in enumerate(zip(case.kv_lens, case.q_lens)):
        row = inputs["req_to_token"][inputs["req_pool_indices"][b]]
        prefix = kv_len - q_len
        for i in range(q_len):
            if inputs["custom_mask"] is None:
                new_seen = [j for j in range(q_len) if j <= i]
            else:
                new_seen = [j for j in range(q_len) if inputs["custom_mask"][b, i, j]]
            positions = list(range(prefix)) + [prefix + j for j in new_seen]
            slots = row[positions].long()
            for h in range(case.num_heads):
                keys = k_cache[slots, h // group]  # [n, D]
                values = v_cache[slots, h // group]
                weights = torch.softmax(keys @ q[token, h] * inputs["scale"], dim=0)
                out[token, h] = weights @ values
            token += 1
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_naive_loop(name):
    case = CASES[name]
    inputs = build_inputs(case)
    ref = paged_attention_reference(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["meta"], inputs["scale"])
    expected = naive_attention(case, inputs)
    assert ref.shape == expected.shape
    assert tolerance_ratio(ref, expected, case.dtype) <= 1.0


def _ordered_matmul(a, b, dtype):
    """a [M, K] @ b [K, N] in ``dtype``, each element's products added in k order: an element depends
    only on its row of a and its column of b, as on the GPU's MMA, never on where the row sits in the
    tile. numpy's matmul gives no such promise: OpenBLAS's Haswell sgemm kernels (what it picks on AVX2
    CPUs, and on a Zen 5) round a row differently by its position in the tile."""
    import numpy as np

    a, b = a.astype(dtype), b.astype(dtype)
    acc = np.zeros((a.shape[0], b.shape[1]), dtype)
    for k in range(a.shape[1]):
        acc = acc + a[:, k:k + 1] * b[k:k + 1, :]
    return acc


def _patch_interpreter_dot() -> bool:
    """Make the interpreter's ``tl.dot`` row-independent and correct for bf16 operands; False if it
    cannot.

    The interpreter stores bf16 as raw uint16 bits and its ``tl.dot`` multiplies those bits
    (triton-lang/triton#11584; upstream: bf16 is "not supported yet" in the interpreter). Casts,
    loads and stores of bf16 are right, so upcasting the dot operands to fp32 lets the kernel's
    bf16 path run as written; a bf16 x bf16 product is exact in fp32, as on the GPU's MMA. Its
    float dots go through ``_ordered_matmul``, so the invariance checks test the kernel's blocking,
    not the host's BLAS.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

        original_dot = InterpreterBuilder.create_dot
        cast = InterpreterBuilder.cast_impl
    except (ImportError, AttributeError):
        return False

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.dtype.scalar == tl.bfloat16:
            a = cast(self, a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = cast(self, b, tl.float32)
        floats = (np.float16, np.float32)
        if a.data.ndim == 2 and b.data.ndim == 2 and a.data.dtype in floats and b.data.dtype in floats:
            return TensorHandle(_ordered_matmul(a.data, b.data, d.data.dtype) + d.data, d.dtype.scalar)
        return original_dot(self, a, b, d, *args, **kwargs)

    InterpreterBuilder.create_dot = create_dot
    return True


def _kernel_worker() -> None:
    """Run in the subprocess: every case through the kernel (compiled on a GPU, else interpreted) and
    the torch reference on the same device, errors printed as JSON."""
    from specjet.kernels.triton_attention import paged_attention_triton

    bf16_ok = _patch_interpreter_dot() if interpreted() else True

    def run_case(case):
        if case.dtype == torch.bfloat16 and not bf16_ok:
            return {"skip": "the Triton interpreter cannot compute bf16 tl.dot (triton#11584)"}
        inputs = to_kernel_device(build_inputs(case))
        args = (inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["meta"], inputs["scale"])
        ref = paged_attention_reference(*args)
        out = paged_attention_triton(*args)
        return {
            "shape_ok": out.shape == ref.shape and out.dtype == ref.dtype,
            "tolerance_ratio": tolerance_ratio(out, ref, case.dtype),
            "finite": bool(torch.isfinite(out).all()),
        }

    def run_invariance(case):
        """The invariant kernel on a tree / chain / prefill batch, and every new token again as a lone
        decode row that reads the keys it saw (prefix, then the new tokens it may see) at consecutive
        positions from copies in fresh slots: the rows must agree bit for bit."""
        if case.dtype == torch.bfloat16 and not bf16_ok:
            return {"skip": "the Triton interpreter cannot compute bf16 tl.dot (triton#11584)"}
        inputs = build_inputs(case)
        meta, scale = inputs["meta"], inputs["scale"]
        k_cache, v_cache = inputs["k_cache"], inputs["v_cache"]
        dev = to_kernel_device
        together = paged_attention_triton(dev(inputs["q"]), dev(k_cache), dev(v_cache), dev(meta), scale,
                                          invariant=True).cpu()
        mismatched, token = [], 0
        for b, (kv_len, q_len) in enumerate(zip(case.kv_lens, case.q_lens)):
            row = inputs["req_to_token"][inputs["req_pool_indices"][b]]
            prefix = kv_len - q_len
            for i in range(q_len):
                if inputs["custom_mask"] is None:
                    seen = list(range(i + 1))
                else:
                    seen = [j for j in range(q_len) if inputs["custom_mask"][b, i, j]]
                slots = row[list(range(prefix)) + [prefix + j for j in seen]].long()
                # Fresh slots (past the pool) holding copies of exactly those keys and values.
                k_big = torch.cat([k_cache, k_cache[slots]])
                v_big = torch.cat([v_cache, v_cache[slots]])
                table = (k_cache.shape[0] + torch.arange(len(slots)))[None, :]
                alone_meta = build_attention_metadata(table, torch.tensor([0]), [len(slots)], [1])
                alone = paged_attention_triton(dev(inputs["q"][token:token + 1]), dev(k_big), dev(v_big),
                                               dev(alone_meta), scale, invariant=True).cpu()
                if not torch.equal(alone[0], together[token]):
                    mismatched.append(token)
                token += 1
        return {"mismatched": mismatched, "rows": token}

    report_cases(dict({name: case for name, case in CASES.items()},
                      **{f"invariant:{name}": ("invariant", CASES[name]) for name in INVARIANCE_CASES}),
                 lambda case: run_invariance(case[1]) if isinstance(case, tuple) else run_case(case))


# Batches whose every row is checked against the same token decoded alone (``invariant=True``): a tree
# with ancestors among non-ancestors, mixed prefill and decode rows, a GQA prefill spanning KV blocks.
INVARIANCE_CASES = ["tree_verify", "extend_mixed", "gqa_smollm2_extend", "tree_verify_fp16_gqa", "extend_bf16"]


@pytest.fixture(scope="module")
def kernel_report() -> dict:
    return run_kernel_worker(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_reference(kernel_report, name):
    result = kernel_report[name]
    if "skip" in result:
        pytest.skip(result["skip"])
    assert "error" not in result, result.get("error")
    assert result["shape_ok"]
    assert result["finite"]
    assert result["tolerance_ratio"] <= 1.0, result


@pytest.mark.parametrize("name", INVARIANCE_CASES)
def test_invariant_kernel_gives_each_row_the_bits_of_its_lone_decode(kernel_report, name):
    result = kernel_report[f"invariant:{name}"]
    if "skip" in result:
        pytest.skip(result["skip"])
    assert "error" not in result, result.get("error")
    assert result["rows"] == sum(CASES[name].q_lens)
    assert result["mismatched"] == [], result


if __name__ == "__main__" and "--kernel-worker" in sys.argv:
    _kernel_worker()


def test_rows_as_requests_lists_the_prefix_then_the_visible_new_tokens():
    """The invariant view of a masked batch, read directly: padded query slot (b, i) becomes a request
    of one new token whose KV row is b's prefix slots followed by the slots of the new tokens i may see,
    in their order (an oracle written out by hand from the tree's parents)."""
    from specjet.kernels.attention_metadata import rows_as_requests

    case = CASES["tree_verify"]  # kv_lens [20, 7], q_lens [7, 4]: request 1's slots 4..6 are padding
    inputs = build_inputs(case)
    meta, table, pool_rows = inputs["meta"], inputs["req_to_token"], inputs["req_pool_indices"]
    view = rows_as_requests(meta)
    max_q = max(case.q_lens)
    assert view.max_q == 1 and view.custom_mask is None and view.kv_indices.shape == (2 * max_q, meta.max_kv)
    for b, (kv_len, q_len, parents) in enumerate(zip(case.kv_lens, case.q_lens, case.tree_parents)):
        prefix = kv_len - q_len
        row = table[pool_rows[b]]
        for i in range(max_q):
            r = b * max_q + i
            if i >= q_len:
                assert view.q_lens[r] == 0 and view.kv_lens[r] == 0
                continue
            path, node = [], i
            while node != -1:
                path.append(node)
                node = parents[node]
            expected = row[list(range(prefix)) + [prefix + j for j in sorted(path)]].tolist()
            assert view.q_lens[r] == 1 and view.q_starts[r] == meta.q_gather[b, i]
            assert view.kv_lens[r] == len(expected)
            assert view.kv_indices[r, :len(expected)].tolist() == expected
