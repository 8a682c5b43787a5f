"""Helpers the speculative sampling tests share: a speculative engine of each algorithm, the mean accept length of
a set of outputs, a prompt after which n-gram drafts are taken, and the exact two-token top-k distribution of a
transformers model (with a logit bias) with its total variation from seeded draws."""
from __future__ import annotations

import collections

import torch

import specjet
from test_dflash_spec import dflash_engine


def spec_engine(algorithm, model_dir, head, draft, overlap, path=10, **kw):
    """A speculative engine of ``algorithm`` (EAGLE with ``head``, DFLASH with ``draft``; both with an n-gram path
    of ``path`` nodes), every iteration drafting; ``algorithm`` None: an engine without speculation (which drafts
    for requests with a prediction or a grammar alone)."""
    if algorithm is None:
        return specjet.Engine(model_path=str(model_dir), **dict(dict(max_total_tokens=4096,
                                                                     disable_overlap_schedule=not overlap), **kw))
    common = dict(dict(max_total_tokens=4096, disable_overlap_schedule=not overlap, speculative_measured_payoff=False),
                  **kw)
    if algorithm == "DFLASH":
        return dflash_engine(model_dir, draft, speculative_hybrid_ngram_tokens=path, **common)
    if algorithm == "EAGLE":
        return specjet.Engine(model_path=str(model_dir), speculative_algorithm="EAGLE",
                              speculative_draft_model_path=str(head), speculative_num_steps=2,
                              speculative_eagle_topk=2, speculative_num_draft_tokens=6,
                              speculative_hybrid_ngram_tokens=path, **common)
    return specjet.Engine(model_path=str(model_dir), speculative_algorithm="NGRAM",
                          speculative_num_draft_tokens=10, **common)


def repeating_prompt(engine, prompt: str, tokens: int = 24) -> str:
    """``prompt`` followed by ``engine``'s own greedy continuation. A small random model's output repeats its
    pieces, so a token sampled next most likely occurred in that continuation, and an n-gram tree proposes what
    followed it there: a draw of a few tokens then verifies drafts the target takes part of the time (after a
    prompt without the model's pieces every tree is its root alone, and a sampling test checks no acceptance)."""
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True})
    return prompt + out["text"]


def mean_accept(outs) -> float:
    return sum(o["meta_info"]["spec_accept_length"] for o in outs) / len(outs)


def biased_topk(model, ids, bias, top_k):
    """The target's top-k distribution after ``ids`` with ``bias`` added to its logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    for token, value in bias.items():
        logits[token] += value
    vals, idx = logits.topk(top_k)
    return dict(zip(idx.tolist(), torch.softmax(vals, -1).tolist()))


def two_token_distribution(model, prompt_ids, bias, top_k=3) -> dict:
    """P(t1, t2) of sampling two tokens after ``prompt_ids`` from the biased top-k distributions."""
    exact = {}
    for t1, p1 in biased_topk(model, prompt_ids, bias, top_k).items():
        for t2, p2 in biased_topk(model, prompt_ids + [t1], bias, top_k).items():
            exact[(t1, t2)] = p1 * p2
    return exact


def total_variation(outs, exact: dict) -> float:
    """Between the outputs' first-two-token histogram and ``exact``."""
    counts = collections.Counter(tuple(o["output_ids"][:2]) for o in outs)
    n = len(outs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
