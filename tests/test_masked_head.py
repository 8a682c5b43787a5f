"""The LM head under grammar masks (QuantizedLinear.masked, Bf16Linear.masked) in constrained decoding, end to
end on the default model (GGUF, an int8 head; and the same model in bf16 where the CPU runs specjet's VDPBF16PS
GEMM): a decode batch under a grammar leaves its head to the sampling, which computes only the allowed
columns of rows whose mask allows few. Outputs equal those of the full head (the engine with the deferral
off), greedy and seeded sampling, alone and beside free text; in bf16 a speculative verify (its rows' heads
under their masks) gives plain decoding's tokens."""
from __future__ import annotations

import json

import jsonschema
import pytest

import specjet
from specjet.kernels import argmax_bound, bf16_gemm, qgemm

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}
TEXT = "Describe a person as JSON with a name, an age and three tags."


def _run(defer: bool, prompt_text: str, **engine_kwargs) -> tuple[list[list[int]], str]:
    # Plain decode batches (the deferred head is theirs): constrained requests would otherwise draft.
    with specjet.Engine(max_total_tokens=8192, disable_guided_drafting=True, **engine_kwargs) as eng:
        assert eng.worker._defer_head  # the head (int8, or bf16 on the VDPBF16PS kernel) takes masks
        eng.worker._defer_head = defer
        prompt = eng.apply_chat_template(prompt_text)
        greedy = {"temperature": 0, "max_new_tokens": 64, "json_schema": SCHEMA}
        sampled = dict(greedy, temperature=0.8, top_p=0.95, seed=7)
        free = {"temperature": 0, "max_new_tokens": 32}
        outs = eng.generate([prompt, prompt, prompt], [greedy, sampled, free])
        alone = eng.generate(prompt, greedy)
        eng.check_kv_invariant()
    return [o["output_ids"] for o in outs] + [alone["output_ids"]], outs[0]["text"]


class _SparseRows:
    """``layer.masked`` wrapped to count, per call, the rows it gave -inf columns (rows that took the sparse head)."""

    def __init__(self, monkeypatch, layer: type):
        self.counts: list[int] = []
        real = layer.masked

        def counting(this, x, bitmask, masked, *args):
            out = real(this, x, bitmask, masked, *args)
            self.counts.append(int((out == float("-inf")).any(dim=1).sum()))
            return out

        monkeypatch.setattr(layer, "masked", counting)

    def take(self) -> int:
        """Sparse rows since the last call."""
        n, self.counts = sum(self.counts), []
        return n


@pytest.mark.skipif(qgemm.extension() is None, reason="the C++ extension is not built")
def test_deferred_masked_head_decodes_as_the_full_head(monkeypatch):
    sparse = _SparseRows(monkeypatch, qgemm.QuantizedLinear)
    deferred, text_out = _run(True, TEXT)
    assert sparse.take() > 0  # rows whose grammar allowed few tokens took the sparse head
    full, _ = _run(False, TEXT)
    assert sparse.take() == 0  # the head ran in the forward, over every column
    assert deferred == full
    assert deferred[0] == deferred[3]  # batched == alone
    jsonschema.validate(json.loads(text_out), SCHEMA)


@pytest.mark.skipif(bf16_gemm.default_isa() != "avx512_bf16",
                    reason="the bf16 head takes masks on the VDPBF16PS kernel (CPUs with AVX-512 BF16, no AMX)")
def test_bf16_masked_head_decodes_as_the_full_head_and_a_verify_as_plain_decoding(monkeypatch):
    # Grammar masks alone: greedy rows' argmax bound (tests/test_argmax_bound.py) would mask rows of the full head too.
    monkeypatch.setenv(argmax_bound.ENV, "off")
    bf16 = {"dtype": "bfloat16", "quantization": None}
    sparse = _SparseRows(monkeypatch, bf16_gemm.Bf16Linear)
    deferred, text_out = _run(True, TEXT, **bf16)
    assert sparse.take() > 0
    full, _ = _run(False, TEXT, **bf16)
    assert sparse.take() == 0
    assert deferred == full
    assert deferred[0] == deferred[3]
    jsonschema.validate(json.loads(text_out), SCHEMA)
    with specjet.Engine(max_total_tokens=8192, speculative_algorithm="DFLASH", **bf16) as eng:
        prompt = eng.apply_chat_template(TEXT)
        out = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 64, "json_schema": SCHEMA})
        eng.check_kv_invariant()
    assert sparse.take() > 0  # the verify's rows under narrow masks took the sparse head
    assert out["output_ids"] == deferred[0]
