"""The LM head under grammar masks (QuantizedLinear.masked) in plain constrained decoding, end to end on
the default model (GGUF, an int8 head): a decode batch under a grammar leaves its head to the sampling,
which computes only the allowed columns of rows whose mask allows few. Outputs equal those of the full
head (the engine with the deferral off), greedy and seeded sampling, alone and beside free text."""
from __future__ import annotations

import json

import jsonschema
import pytest

import specjet
from specjet.kernels import qgemm

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}


def _run(defer: bool, prompt_text: str) -> tuple[list[list[int]], str]:
    with specjet.Engine(max_total_tokens=8192) as eng:
        assert eng.worker._defer_head  # the default model's head is int8 on this CPU's kernels
        eng.worker._defer_head = defer
        prompt = eng.apply_chat_template(prompt_text)
        greedy = {"temperature": 0, "max_new_tokens": 64, "json_schema": SCHEMA}
        sampled = dict(greedy, temperature=0.8, top_p=0.95, seed=7)
        free = {"temperature": 0, "max_new_tokens": 32}
        outs = eng.generate([prompt, prompt, prompt], [greedy, sampled, free])
        alone = eng.generate(prompt, greedy)
        eng.check_kv_invariant()
    return [o["output_ids"] for o in outs] + [alone["output_ids"]], outs[0]["text"]


@pytest.mark.skipif(qgemm.extension() is None, reason="the C++ extension is not built")
def test_deferred_masked_head_decodes_as_the_full_head(monkeypatch):
    sparse_rows = []
    real = qgemm.QuantizedLinear.masked

    def counting(self, x, bitmask, masked, *args):
        out = real(self, x, bitmask, masked, *args)
        sparse_rows.append(int((out == float("-inf")).any(dim=1).sum()))
        return out

    monkeypatch.setattr(qgemm.QuantizedLinear, "masked", counting)
    text = "Describe a person as JSON with a name, an age and three tags."
    deferred, text_out = _run(True, text)
    assert sum(sparse_rows) > 0  # rows whose grammar allowed few tokens took the sparse head
    sparse_rows.clear()
    full, _ = _run(False, text)
    assert not sparse_rows  # the head ran in the forward, over every column
    assert deferred == full
    assert deferred[0] == deferred[3]  # batched == alone
    jsonschema.validate(json.loads(text_out), SCHEMA)
