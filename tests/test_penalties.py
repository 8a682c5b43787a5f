"""Frequency, presence and repetition penalties: the formula on a row by hand; validated at the
door; they change plain output; speculative decoding (NGRAM, EAGLE, the hybrid; overlap and plain
loop; under a grammar) gives exactly plain decoding's greedy ids with them, and under sampling the
penalised target distribution (checked against an oracle written here from the definitions)."""
from __future__ import annotations

import collections

import pytest
import torch

import specjet
from specjet.kernels.penalties import Penalties, apply_penalties_, context_rows
from test_spec_eagle import random_head

PROMPTS = ["a b c a b c a b", "The cat sat on the mat. The cat", "1 2 3 4 1 2", "Hello"]
PENALTIES = {"frequency_penalty": 0.7, "presence_penalty": 0.4, "repetition_penalty": 1.3}
# Strong enough to break the cycles the cyclic model's greedy output falls into, so a draft path
# that repeats a token is penalised at the next node exactly when plain decoding would be.
STRONG = {"frequency_penalty": 1.5, "presence_penalty": 1.0, "repetition_penalty": 1.6}
SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 6}},
          "required": ["tags"]}


def greedy(n, **extra):
    return dict({"temperature": 0, "max_new_tokens": n, "ignore_eos": True}, **extra)


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    # prompt [3], output [0, 0, 1]: counts 2, 1 for tokens 0, 1; seen {0, 1, 3}
    counts, seen = context_rows([[3, 0, 0, 1]], [1], 5)
    assert counts.tolist() == [[2.0, 1.0, 0.0, 0.0, 0.0]] and seen.tolist() == [[True, True, False, True, False]]
    apply_penalties_(logits, counts, seen, [Penalties(frequency=0.5, presence=0.25, repetition=2.0)], [0])
    expected = [2.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2, -2.0]
    assert logits.tolist() == [pytest.approx(expected)]
    neutral = torch.tensor([[1.5, -0.5, float("-inf")]])
    apply_penalties_(neutral, *context_rows([[0, 1]], [0], 3), [Penalties()], [0])
    assert neutral.tolist() == [[1.5, -0.5, float("-inf")]]  # no penalty: the same bits


@pytest.mark.parametrize("name, value", [("frequency_penalty", 2.5), ("presence_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", 1e-38),
                                         ("repetition_penalty", float("nan"))])
def test_out_of_range_penalties_are_refused(plain, name, value):
    with pytest.raises(ValueError, match=name):
        plain.generate("a", {name: value})
    with pytest.raises(TypeError, match=name):
        plain.generate("a", {name: "1"})
    assert plain.generate(["a", "b"], greedy(2))[1]["meta_info"]["completion_tokens"] == 2  # the engine goes on
    plain.check_kv_invariant()


@pytest.fixture(scope="module")
def expected(cyclic_model_dir):
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, disable_guided_drafting=True) as plain:
        with_penalties = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(40, **STRONG))]
        without = [o["output_ids"] for o in plain.generate(PROMPTS, greedy(40))]
        constrained = plain.generate(PROMPTS, greedy(40, json_schema=SCHEMA, **STRONG))
        plain.check_kv_invariant()
    assert with_penalties != without  # they do something
    return with_penalties, [o["output_ids"] for o in constrained]


@pytest.fixture(scope="module")
def head(tmp_path_factory, cyclic_model_dir):
    return random_head(tmp_path_factory.mktemp("penalty-head"), cyclic_model_dir)


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE", "EAGLE+NGRAM"])
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_speculation_with_penalties_equals_plain(cyclic_model_dir, head, expected, algorithm, overlap):
    kw = {"speculative_algorithm": algorithm.split("+")[0]}
    if algorithm.startswith("EAGLE"):
        kw.update(speculative_draft_model_path=str(head), speculative_num_steps=3, speculative_eagle_topk=2,
                  speculative_num_draft_tokens=8, speculative_hybrid_ngram_tokens=4 if "+" in algorithm else 0)
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, disable_overlap_schedule=not overlap,
                        **kw) as eng:
        outs = eng.generate(PROMPTS, greedy(40, **STRONG))
        constrained = eng.generate(PROMPTS, greedy(40, json_schema=SCHEMA, **STRONG))
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == expected[0]
    assert [o["output_ids"] for o in constrained] == expected[1]
    assert any(o["meta_info"]["spec_accept_length"] > 1 for o in outs + constrained)


def penalised_topk(model, prompt_ids, output, top_k):
    """The target's top-k distribution after prompt + output with PENALTIES, from the definitions:
    a logit of a token seen in prompt or output is divided by the repetition penalty when positive
    (multiplied when not), then the frequency penalty times its count in the output and the
    presence penalty if it occurs there are subtracted."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output])).logits[0, -1].float()
    for token in set(prompt_ids + output):
        rep = PENALTIES["repetition_penalty"]
        logits[token] = logits[token] / rep if logits[token] > 0 else logits[token] * rep
    for token, count in collections.Counter(output).items():
        logits[token] -= PENALTIES["frequency_penalty"] * count + PENALTIES["presence_penalty"]
    vals, idx = logits.topk(top_k)
    return dict(zip(idx.tolist(), torch.softmax(vals, -1).tolist()))


def test_sampling_with_penalties_matches_the_penalised_target(cyclic_model_dir):
    """1000 seeded draws of three tokens with NGRAM: the (t1, t2) histogram matches the penalised top-k
    distribution (t2 and t3 come from tree verification, where each node is penalised by its own path). The
    penalties break the cycles an n-gram tree would draft, so the request's prediction (the penalised target's
    likeliest three tokens) drafts instead: its t2 is taken part of the time."""
    from transformers import AutoModelForCausalLM

    prompt, n = PROMPTS[0], 1000
    model = AutoModelForCausalLM.from_pretrained(cyclic_model_dir, dtype=torch.float32)
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=8192, dtype="float32",
                        speculative_algorithm="NGRAM") as eng:
        prompt_ids = eng.tokenizer(prompt)["input_ids"]
        likeliest: list[int] = []
        for _ in range(3):
            top = penalised_topk(model, prompt_ids, likeliest, 3)
            likeliest.append(max(top, key=top.get))
        params = [dict(PENALTIES, temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True, seed=s,
                       prediction=likeliest) for s in range(n)]
        outs = eng.generate([prompt] * n, params)
        eng.check_kv_invariant()
    assert sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs) > n // 20  # drafts were accepted
    exact = {}
    for t1, p1 in penalised_topk(model, prompt_ids, [], 3).items():
        for t2, p2 in penalised_topk(model, prompt_ids, [t1], 3).items():
            exact[(t1, t2)] = p1 * p2
    counts = collections.Counter(tuple(o["output_ids"][:2]) for o in outs)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    assert tv < 0.07, tv


def test_each_tree_node_is_penalised_by_its_own_path():
    """Verification penalises node i's logits as plain decoding would after the request's tokens and
    the draft tokens on i's path (root excluded: it is the last token so far); oracle from the
    definitions."""
    from specjet.spec_v2.tree_verifier import TreeVerifier, VerifyInput

    vocab, prompt_len = 12, 2
    context = [5, 6, 5, 7]  # prompt [5, 6], output [5, 7]; the root is 7
    tokens, parents = [7, 3, 7, 4, 3], [-1, 0, 1, 1, 3]  # paths: [], [3], [3, 7], [3, 4], [3, 4, 3]
    paths = [[], [3], [3, 7], [3, 4], [3, 4, 3]]
    pen = Penalties(frequency=0.5, presence=0.25, repetition=1.5)
    torch.manual_seed(0)
    logits = torch.randn(len(tokens) + 2, vocab)  # two rows of another request before it
    got = logits.clone()
    req = VerifyInput(0, len(context), tokens, parents, None, None, (pen, context, prompt_len))
    other = VerifyInput(1, 3, [1, 2], [-1, 0], None, None, None)
    TreeVerifier._apply_penalties([other, req], got, [0, 2])
    assert torch.equal(got[:2], logits[:2])  # no penalties: untouched
    for i, path in enumerate(paths):
        seq = context + path
        row = logits[2 + i].clone()
        for t in set(seq):
            row[t] = row[t] / 1.5 if row[t] > 0 else row[t] * 1.5
        for t, c in collections.Counter(seq[prompt_len:]).items():
            row[t] -= 0.5 * c + 0.25
        assert torch.allclose(got[2 + i], row), i
