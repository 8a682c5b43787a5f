"""Output logprobs (``return_logprob``, ``top_logprobs_num``): each emitted token's log probability under the
model's own next-token distribution, before grammar masks, penalties and temperature. Checked against
transformers' forward of the same tiny model; the speculative paths (NGRAM, EAGLE, DFLASH, under a grammar too)
report plain decoding's numbers exactly (the same kernels in one process); stream chunks add up to the whole
output. Every workload ends with the KV invariant."""
from __future__ import annotations

import pytest
import torch

import specjet
from conftest import make_tiny_model_dir
from test_dflash_spec import dflash_engine, make_copy_draft
from test_spec_eagle import eagle_engine, random_head
from test_spec_grammar import SCHEMA

PROMPT_IDS = [[504, 2365, 6354, 16438], [253, 255, 272, 253, 255, 272, 253], [28, 216, 33, 216, 34, 216]]


def with_logprobs(params: dict, top: int = 3) -> dict:
    return dict(params, return_logprob=True, top_logprobs_num=top)


def reference_logprobs(model_dir, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax rows that decided each output token: [len(output), V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) + len(output) - 1], dim=-1)


@pytest.mark.parametrize("algorithm", [None, "NGRAM"])
@pytest.mark.parametrize("params", [
    {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 3, "seed": 3, "max_new_tokens": 10, "ignore_eos": True,
     "frequency_penalty": 0.1},
    {"temperature": 0.9, "top_k": 3, "seed": 4, "max_new_tokens": 10, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 24, "json_schema": SCHEMA},
])
def test_logprobs_are_the_models_own_distribution(tiny_model_dir, cyclic_dir, params, algorithm):
    """Whatever the sampling, the mask or the penalties, plain or speculative (a verify takes a greedy walk's rows
    after it, a sampled or penalised one's before the walk changes them): the reported numbers are the model's
    log-softmax at the token's position (transformers computes it here), best alternatives first; greedy picks the
    best. NGRAM runs on the cyclic model, whose outputs repeat, so that its verifies take drafts."""
    model_dir = cyclic_dir if algorithm else tiny_model_dir
    with specjet.Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=4096,
                        speculative_algorithm=algorithm, speculative_measured_payoff=False) as eng:
        outs = eng.generate(input_ids=PROMPT_IDS, sampling_params=with_logprobs(params))
        eng.check_kv_invariant()
    if algorithm:  # some verify took a draft (a penalty or a sample rejects many on this small a run)
        assert any(max(o["meta_info"]["spec_accept_histogram"]) >= 2 for o in outs)
    for prompt, out in zip(PROMPT_IDS, outs):
        ids, meta = out["output_ids"], out["meta_info"]
        pairs, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
        assert len(pairs) == len(tops) == len(ids) > 0
        assert [t for _, t, text in pairs] == ids and all(text is None for _, _, text in pairs)
        ref = reference_logprobs(model_dir, prompt, ids)
        chosen = ref.gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([lp for lp, _, _ in pairs]), chosen, atol=2e-4), (pairs, chosen)
        ref_top = ref.topk(3, dim=-1)
        for j, top in enumerate(tops):
            assert [t for _, t, _ in top] == ref_top.indices[j].tolist()
            assert torch.allclose(torch.tensor([lp for lp, _, _ in top]), ref_top.values[j], atol=2e-4)
            if params["temperature"] == 0 and "json_schema" not in params:
                assert top[0][1] == ids[j] and top[0][0] == pairs[j][0]


@pytest.fixture(scope="module")
def cyclic_dir(tmp_path_factory, default_model_dir):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-cyclic-logprobs"), default_model_dir, weight_std=0.05)


@pytest.fixture(scope="module")
def plain_outputs(cyclic_dir):
    with specjet.Engine(model_path=str(cyclic_dir), max_total_tokens=4096, disable_guided_drafting=True) as eng:
        outs = eng.generate(input_ids=PROMPT_IDS + PROMPT_IDS[:1], sampling_params=MIXED_PARAMS)
        eng.check_kv_invariant()
    return outs


# Two requests ask for logprobs (one under a schema), one asks for none, one asks without alternatives.
MIXED_PARAMS = [with_logprobs({"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}),
                {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
                with_logprobs({"temperature": 0, "max_new_tokens": 40, "json_schema": SCHEMA}, top=5),
                with_logprobs({"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}, top=0)]


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE", "DFLASH"])
def test_speculative_logprobs_are_plain_decodings(cyclic_dir, plain_outputs, algorithm, tmp_path):
    """A verify reports, for each accepted token and the bonus, the row of the node that decided it: the numbers
    plain decoding reports, exactly, in a mixed batch with a request under a schema and one asking for none."""
    if algorithm == "NGRAM":
        engine = specjet.Engine(model_path=str(cyclic_dir), speculative_algorithm="NGRAM", max_total_tokens=4096)
    elif algorithm == "EAGLE":
        engine = eagle_engine(cyclic_dir, random_head(tmp_path, cyclic_dir))
    else:
        engine = dflash_engine(cyclic_dir, make_copy_draft(tmp_path, cyclic_dir))
    with engine as eng:
        outs = eng.generate(input_ids=PROMPT_IDS + PROMPT_IDS[:1], sampling_params=MIXED_PARAMS)
        eng.check_kv_invariant()
    for out, plain, params in zip(outs, plain_outputs, MIXED_PARAMS):
        assert out["output_ids"] == plain["output_ids"]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            assert out["meta_info"].get(key) == plain["meta_info"].get(key), key
        assert ("output_token_logprobs" in out["meta_info"]) == params.get("return_logprob", False)
        assert ("output_top_logprobs" in out["meta_info"]) == bool(params.get("top_logprobs_num"))
    if algorithm != "EAGLE":  # a random head is always wrong; the n-grams and the copy draft are taken
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) < sum(len(o["output_ids"]) for o in outs)


def test_stream_chunks_carry_their_own_tokens_logprobs(cyclic_dir, plain_outputs):
    with specjet.Engine(model_path=str(cyclic_dir), speculative_algorithm="NGRAM", max_total_tokens=4096) as eng:
        chunks = list(eng.generate(input_ids=PROMPT_IDS[0], sampling_params=MIXED_PARAMS[0], stream=True))
        eng.check_kv_invariant()
    assert all(len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"]) for c in chunks)
    assert [p for c in chunks for p in c["meta_info"]["output_token_logprobs"]] == \
        plain_outputs[0]["meta_info"]["output_token_logprobs"]
    assert [p for c in chunks for p in c["meta_info"]["output_top_logprobs"]] == \
        plain_outputs[0]["meta_info"]["output_top_logprobs"]


@pytest.mark.parametrize("params,error,match", [
    ({"return_logprob": 1}, TypeError, "return_logprob must be a bool"),
    ({"return_logprob": True, "top_logprobs_num": 21}, ValueError, r"top_logprobs_num must be in \[0, 20\]"),
    ({"return_logprob": True, "top_logprobs_num": -1}, ValueError, "top_logprobs_num"),
    ({"return_logprob": True, "top_logprobs_num": 2.0}, TypeError, "top_logprobs_num must be an int"),
    ({"top_logprobs_num": 3}, ValueError, "needs return_logprob=True"),
])
def test_bad_logprob_parameters_fail_at_the_door(tiny_model_dir, params, error, match):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024) as eng:
        with pytest.raises(error, match=match):
            eng.generate("hi", params)
        assert eng.generate("hi", {"max_new_tokens": 2})["output_ids"]
        eng.check_kv_invariant()


def test_sglang_arguments_set_the_same_parameters(cyclic_dir, plain_outputs):
    """``generate(..., return_logprob=, top_logprobs_num=)`` as SGLang's Engine takes them (a value, or one per
    prompt): the same outputs as the sampling parameters of those names."""
    greedy = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with specjet.Engine(model_path=str(cyclic_dir), max_total_tokens=4096) as eng:
        both = eng.generate(input_ids=PROMPT_IDS[:2], sampling_params=greedy, return_logprob=[True, False],
                            top_logprobs_num=[3, 0])
        one = eng.generate(input_ids=PROMPT_IDS[0], sampling_params=greedy, return_logprob=True, top_logprobs_num=3)
        with pytest.raises(ValueError, match="1 return_logprob values for 2 prompts"):
            eng.generate(input_ids=PROMPT_IDS[:2], sampling_params=greedy, return_logprob=[True])
        with pytest.raises(ValueError, match="top_logprobs_num needs return_logprob=True"):
            eng.generate(input_ids=PROMPT_IDS[0], sampling_params=greedy, top_logprobs_num=2)
        # An argument given with the other as a sampling parameter: both count (the arguments' defaults overwrote
        # the parameters, dropping the alternatives or refusing a pair the caller had made whole).
        mixed = [eng.generate(input_ids=PROMPT_IDS[0], sampling_params=dict(greedy, **params), **arguments)
                 for params, arguments in (({"top_logprobs_num": 3}, {"return_logprob": True}),
                                           ({"return_logprob": True}, {"top_logprobs_num": 3}),
                                           ({"logprob_start_len": 0}, {"return_logprob": True}))]
        eng.check_kv_invariant()
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert both[0]["meta_info"][key] == plain_outputs[0]["meta_info"][key]
    assert one["meta_info"]["output_token_logprobs"] == plain_outputs[0]["meta_info"]["output_token_logprobs"]
    assert "output_token_logprobs" not in both[1]["meta_info"]
    for out in mixed[:2]:
        assert out["meta_info"]["output_top_logprobs"] == plain_outputs[0]["meta_info"]["output_top_logprobs"]
    assert len(mixed[2]["meta_info"]["input_token_logprobs"]) == len(PROMPT_IDS[0])


@pytest.mark.parametrize("start", [0, 3])
def test_prompt_logprobs_are_the_models_chunked_cached_and_speculative(tiny_model_dir, start):
    """``logprob_start_len``: the prompt's tokens from there on (the first token None), against transformers; the
    same after a chunked prefill, after the prompt is in the prefix cache (the cache then gives only positions
    before the asked rows), and on a speculative engine."""
    prompt = [504, 2365, 6354, 16438, 253, 255, 272, 253, 255, 272, 28]
    params = {"temperature": 0, "max_new_tokens": 4, "return_logprob": True, "top_logprobs_num": 2,
              "logprob_start_len": start}
    ref = reference_logprobs(tiny_model_dir, prompt[:1], prompt[1:])  # row p - 1 decided prompt token p
    runs = []
    for kwargs in ({}, {"chunked_prefill_size": 4}, {"speculative_algorithm": "NGRAM"}):
        with specjet.Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096, **kwargs) as eng:
            first = eng.generate(input_ids=prompt, sampling_params=params)
            again = eng.generate(input_ids=prompt, sampling_params=params)  # the prompt is cached now
            eng.check_kv_invariant()
        assert again["meta_info"]["cached_tokens"] == max(start - 1, 0)
        runs += [first["meta_info"], again["meta_info"]]
    for meta in runs:
        pairs, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert [t for _, t, _ in pairs] == prompt[start:]
        assert (pairs[0][0] is None and tops[0] is None) == (start == 0)
        got = torch.tensor([lp for lp, _, _ in pairs[1 if start == 0 else 0:]])
        want = ref[max(start, 1) - 1:].gather(1, torch.tensor(prompt[max(start, 1):])[:, None])[:, 0]
        assert torch.allclose(got, want, atol=2e-4), (got, want)
        assert [[t for _, t, _ in top] for top in tops if top is not None] == \
            ref[max(start, 1) - 1:].topk(2, dim=-1).indices.tolist()
    # The same bits on every path: one prefill, chunks, a cached prefix, the speculative engine's prefill.
    assert all(m["input_token_logprobs"] == runs[0]["input_token_logprobs"] for m in runs)


def test_a_prefill_scores_only_the_asking_requests_rows(tiny_model_dir, monkeypatch):
    """A prefill batch with a prompt-logprob request runs the LM head over that request's scored rows and each
    request's last row, not over its neighbours' prompts; both answer as they do alone."""
    asker = [504, 2365, 6354, 16438, 253, 255, 272, 253, 255, 272, 28]
    neighbour = list(range(1000, 1060))
    ask = {"temperature": 0, "max_new_tokens": 3, "return_logprob": True, "logprob_start_len": 3}
    plain = {"temperature": 0, "max_new_tokens": 3}
    with specjet.Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096,
                        disable_radix_cache=True) as eng:
        alone = [eng.generate(input_ids=neighbour, sampling_params=plain),
                 eng.generate(input_ids=asker, sampling_params=ask)]
        model = eng.worker.runner.model
        rows, real = [], model.head_logits
        monkeypatch.setattr(model, "head_logits", lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k))
        both = eng.generate(input_ids=[neighbour, asker], sampling_params=[plain, ask])
        eng.check_kv_invariant()
    # Rows 2..9 (prompt tokens 3..10), its last row and the neighbour's last (all 71 of the batch before).
    assert max(rows) == (len(asker) - 3) + 2
    assert [o["output_ids"] for o in both] == [o["output_ids"] for o in alone]
    assert both[1]["meta_info"]["input_token_logprobs"] == alone[1]["meta_info"]["input_token_logprobs"]


def test_prompt_logprob_parameters_fail_at_the_door(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024) as eng:
        with pytest.raises(ValueError, match="logprob_start_len needs return_logprob=True"):
            eng.generate("hi", {"logprob_start_len": 0})
        with pytest.raises(ValueError, match="logprob_start_len must be -1"):
            eng.generate("hi", {"return_logprob": True, "logprob_start_len": -2})
        with pytest.raises(TypeError, match="logprob_start_len must be an int"):
            eng.generate("hi", {"return_logprob": True, "logprob_start_len": 1.0})
        eng.check_kv_invariant()


@pytest.mark.parametrize("params", [
    {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
    # top_k: over the cyclic model's flat full vocabulary a sampled token is almost never the copy draft's
    {"temperature": 0.8, "top_k": 3, "seed": 5, "max_new_tokens": 24, "ignore_eos": True, "presence_penalty": 0.3},
])
def test_a_dflash_tree_reports_its_accepted_branches_rows(cyclic_dir, params, tmp_path):
    """DFLASH's lattice trees (3 candidates a position) accept paths through nodes that are not consecutive rows:
    each token's numbers come from its own path node, greedy or sampled with a penalty, against transformers."""
    draft = make_copy_draft(tmp_path, cyclic_dir)
    with dflash_engine(cyclic_dir, draft, dtype="float32", speculative_eagle_topk=3) as eng:
        outs = eng.generate(input_ids=PROMPT_IDS, sampling_params=with_logprobs(params))
        eng.check_kv_invariant()
    assert any(max(o["meta_info"]["spec_accept_histogram"]) > 1 for o in outs)  # a verify took drafts
    for prompt, out in zip(PROMPT_IDS, outs):
        ids = out["output_ids"]
        ref = reference_logprobs(cyclic_dir, prompt, ids)
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, ref.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=2e-4)


def test_tied_alternatives_list_in_ascending_id_order_as_greedy_breaks_ties():
    """A bf16 model's logits tie often; the alternatives order equal logprobs by ascending id (greedy decoding's
    first maximum), whatever order torch's topk gives them, and a tie at the list's end keeps the lowest ids."""
    from specjet.kernels.logprobs import logged, top_alternatives

    row = torch.full((50,), -9.0)
    row[[41, 7, 30]] = -1.0  # three-way tie at the top
    row[[45, 12, 3, 28]] = -2.0  # a tie that the list of 5 cuts
    row[20] = -1.5
    expected = sorted(((float(v), i) for i, v in enumerate(row.tolist())), key=lambda t: (-t[0], t[1]))[:5]
    assert top_alternatives(row, 5) == expected == [(-1.0, 7), (-1.0, 30), (-1.0, 41), (-1.5, 20), (-2.0, 3)]
    assert top_alternatives(row, 60) == sorted(((float(v), i) for i, v in enumerate(row.tolist())),
                                               key=lambda t: (-t[0], t[1]))  # more asked for than the row has
    out = logged([int(row.argmax())], row[None], 3)
    assert out.tops[0][0] == (out.logprobs[0], out[0]) == (-1.0, 7)  # the greedy token heads its own list
