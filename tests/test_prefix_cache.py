"""The prefix cache and chunked prefill in the engine: a request served from cached KV gets exactly
the token ids it gets without the cache (plain decoding, EAGLE, NGRAM, DFLASH, under a JSON schema, overlap
on and off, page sizes 1 and 16), prompts sharing prefixes of different lengths and whole cached
prompts; eviction and retraction in a pool smaller than the workload; an abort while a shared
prefix is being prefilled in chunks; chunked prefill == one prefill (greedy and seeded sampling).
Tiny random-weight target (the cyclic one, so a copy head's drafts are accepted); the reference is
an engine with neither the cache nor chunking. The KV invariant (with the cache's own check)
after every workload."""
from __future__ import annotations

import random
import time

import pytest
import torch

import specjet
from test_dflash_spec import make_copy_draft
from test_spec_eagle import copy_head

VOCAB_TOP = 2000  # prompt tokens are drawn below this (ordinary tokens of the shared tokenizer)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB_TOP) for _ in range(n)]


BASE = tokens(0, 70)
# Wave 1 puts prompts in the cache; wave 2 shares prefixes of 5, 17, 33, 40 and 70 tokens with them
# (and with each other), and repeats a whole wave-1 prompt.
WAVE1 = [BASE + tokens(1, 12), BASE[:40] + tokens(2, 20), tokens(3, 25)]
WAVE2 = [BASE[:5] + tokens(4, 9), BASE[:17] + tokens(5, 30), BASE[:33] + tokens(6, 3), BASE + tokens(7, 6),
         list(WAVE1[0]), WAVE1[1][:50] + tokens(8, 11), BASE[:40] + tokens(2, 20) + tokens(9, 4)]


def greedy(n=24, **extra):
    return dict({"temperature": 0, "max_new_tokens": n, "ignore_eos": True}, **extra)


def ids(outs):
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def reference(cyclic_model_dir):
    """Outputs of an engine with neither the cache nor chunked prefill."""
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, disable_radix_cache=True,
                        chunked_prefill_size=-1, disable_guided_drafting=True) as eng:
        yield eng


@pytest.fixture(scope="module")
def expected(reference):
    return ids(reference.generate(input_ids=WAVE1, sampling_params=greedy())), \
        ids(reference.generate(input_ids=WAVE2, sampling_params=greedy()))


@pytest.fixture(scope="module")
def head(tmp_path_factory, cyclic_model_dir, expected):
    return copy_head(tmp_path_factory.mktemp("prefix-head"), cyclic_model_dir, expected[0] + expected[1])


@pytest.fixture(scope="module")
def attending_head(tmp_path_factory, cyclic_model_dir, expected):
    """The copy head with a little attention: its drafts depend on its draft KV, so a cached
    position's draft KV that a miss would not have computed changes its trees."""
    from specjet.models.eagle import load_eagle, save_eagle
    from specjet.models.config import ModelConfig
    from transformers import AutoConfig

    folder = copy_head(tmp_path_factory.mktemp("attending-head"), cyclic_model_dir, expected[0] + expected[1])
    head = load_eagle(folder, ModelConfig.from_hf(AutoConfig.from_pretrained(cyclic_model_dir)), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head.layer.self_attn.qkv_proj.weight_t.normal_(0.0, 0.3, generator=gen)
        head.layer.self_attn.o_proj.weight_t.normal_(0.0, 0.3, generator=gen)
    return save_eagle(head, folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def draft(tmp_path_factory, cyclic_model_dir):
    # A root-context draft: a prefix hit or a chunk must still leave it the last verified context.
    return make_copy_draft(tmp_path_factory.mktemp("prefix-dflash"), cyclic_model_dir, root_context=True, sharpness=10.0)


def engine(model_dir, algorithm=None, head=None, **kw):
    """``head``: the EAGLE head or the DFlash draft."""
    kw.setdefault("max_total_tokens", 4096)
    if algorithm == "EAGLE":
        # The whole tree, uncut: the attending head's nodes fall below the default confidence cut, and a tree of its
        # root alone would never read the draft KV that a prefix hit or a chunk leaves.
        kw.update(speculative_draft_model_path=str(head), speculative_hybrid_ngram_tokens=0,
                  speculative_draft_min_prob=0.0)
    if algorithm == "DFLASH":
        kw.update(speculative_draft_model_path=str(head))
    return specjet.Engine(model_path=str(model_dir), speculative_algorithm=algorithm, **kw)


@pytest.mark.parametrize("algorithm,page_size,overlap", [
    (None, 1, True), (None, 16, False), ("EAGLE", 1, True), ("EAGLE", 16, False), ("NGRAM", 1, False),
    ("NGRAM", 16, True), ("DFLASH", 1, False), ("DFLASH", 16, True)])
def test_cache_hits_give_the_ids_of_misses(cyclic_model_dir, head, draft, expected, algorithm, page_size, overlap):
    with engine(cyclic_model_dir, algorithm, draft if algorithm == "DFLASH" else head, page_size=page_size,
                disable_overlap_schedule=not overlap) as eng:
        first = eng.generate(input_ids=WAVE1, sampling_params=greedy())
        second = eng.generate(input_ids=WAVE2, sampling_params=greedy())
        again = [eng.generate(input_ids=p, sampling_params=greedy()) for p in WAVE2[3:5]]  # whole prompts cached
        eng.check_kv_invariant()
        info = eng.get_server_info()["radix_cache"]
    assert ids(first) == expected[0]
    assert ids(second) == expected[1]
    assert ids(again) == expected[1][3:5]
    cached = [o["meta_info"]["cached_tokens"] for o in second]
    assert all(c % page_size == 0 for c in cached)
    assert cached[3] >= 64 and cached[4] >= 64  # the shared 70-token base and the repeated prompt
    # A whole cached prompt: all but its last token (page-aligned); EAGLE stops before the draft KV
    # of the base's last position, which the cache holds as made by the prompt that went on otherwise.
    whole = len(WAVE2[3]) - 1 - page_size if algorithm != "EAGLE" else len(BASE) - 1 - page_size
    assert again[0]["meta_info"]["cached_tokens"] >= whole
    assert info["hit_tokens"] > 0 and info["cached_tokens"] > 0


def test_eagle_acceptance_is_the_same_on_a_hit(cyclic_model_dir, attending_head, expected):
    """The draft KV a hit reuses is the draft KV a miss computes: the same trees, so the same
    acceptance per request (a cached position whose draft KV was made with another next token
    would change the drafts, not the output)."""
    def run(**kw):
        with engine(cyclic_model_dir, "EAGLE", attending_head, disable_overlap_schedule=True, **kw) as eng:
            for p in WAVE1:
                eng.generate(input_ids=p, sampling_params=greedy())
            outs = [eng.generate(input_ids=p, sampling_params=greedy()) for p in WAVE2]
            eng.check_kv_invariant()
        return outs

    hits, misses = run(), run(disable_radix_cache=True)
    assert ids(hits) == ids(misses) == expected[1]
    assert sum(o["meta_info"]["cached_tokens"] for o in hits) > 100
    assert [o["meta_info"]["spec_accept_histogram"] for o in hits] == \
        [o["meta_info"]["spec_accept_histogram"] for o in misses]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
          "required": ["a", "b"]}


def constrained(n=40):
    params = greedy(n, json_schema=SCHEMA)
    params.pop("ignore_eos")
    return params


@pytest.fixture(scope="module")
def constrained_expected(reference):
    return ids(reference.generate(input_ids=WAVE2, sampling_params=constrained()))


@pytest.fixture(scope="module")
def constrained_head(tmp_path_factory, cyclic_model_dir, expected, constrained_expected):
    """The copy head with the JSON outputs' tokens in its hot vocabulary too: drafts it cannot say
    would leave the constrained EAGLE engine verifying its roots alone."""
    return copy_head(tmp_path_factory.mktemp("constrained-head"), cyclic_model_dir,
                     expected[0] + expected[1] + constrained_expected)


@pytest.mark.parametrize("algorithm", [None, "EAGLE"])
def test_constrained_requests_share_prefixes(cyclic_model_dir, constrained_expected, constrained_head, algorithm):
    # Every iteration drafts (drafting only while it pays depends on timings).
    with engine(cyclic_model_dir, algorithm, constrained_head, speculative_measured_payoff=False) as eng:
        eng.generate(input_ids=WAVE1, sampling_params=constrained())
        outs = eng.generate(input_ids=WAVE2, sampling_params=constrained())
        eng.check_kv_invariant()
    assert ids(outs) == constrained_expected
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 100
    # Drafts were taken on cached prefixes: the head's (EAGLE) or the grammar's forced text (the default engine's).
    assert all(max(o["meta_info"]["spec_accept_histogram"]) >= 2 for o in outs)


@pytest.mark.parametrize("algorithm", [None, "EAGLE"])
def test_eviction_and_retraction_in_a_small_pool(cyclic_model_dir, reference, head, algorithm):
    """Twelve requests sharing a 70-token prefix in a pool that cannot hold them all: cached prefixes
    are evicted for room, requests are retracted and re-run, and every output is still exact."""
    prompts = [BASE + tokens(20 + i, 10) for i in range(12)]
    want = ids(reference.generate(input_ids=prompts, sampling_params=greedy(60)))
    with engine(cyclic_model_dir, algorithm, head, max_total_tokens=700) as eng:
        eng.generate(input_ids=[tokens(40 + i, 60) for i in range(6)], sampling_params=greedy(30))  # fill the cache
        outs = eng.generate(input_ids=prompts, sampling_params=greedy(60))
        eng.check_kv_invariant()
        info = eng.get_server_info()
    assert ids(outs) == want
    assert info["radix_cache"]["evicted_tokens"] > 0
    assert info["stats"]["retractions"] > 0


def test_abort_while_a_shared_prefix_is_prefilled_in_chunks(cyclic_model_dir, reference):
    long = tokens(50, 700)
    sharer = long[:300] + tokens(51, 20)
    want = ids([reference.generate(input_ids=sharer, sampling_params=greedy())])
    with engine(cyclic_model_dir, chunked_prefill_size=16, max_prefill_tokens=64) as eng:
        sched = eng.scheduler
        doomed = eng.generate(input_ids=long, sampling_params=greedy(), rid="doomed", stream=True)
        other = eng.generate(input_ids=sharer, sampling_params=greedy(), rid="sharer", stream=True)

        def abort_mid_prefill():
            req = sched.chunked_req
            if req is None or req.rid != "doomed" or req.kv_committed_len < 320:
                return None
            req.to_abort = True  # as abort_request does, at a chosen point
            return req.kv_committed_len

        deadline = time.monotonic() + 60
        while (at := eng._in_loop(abort_mid_prefill)) is None:
            assert time.monotonic() < deadline
        assert 320 <= at < len(long)
        assert list(doomed)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        chunks = list(other)  # a stream: each chunk carries the new ids
        eng.check_kv_invariant()
    assert [t for c in chunks for t in c["output_ids"]] == want[0]
    # It took the doomed request's computed chunks (once enough were cached for the rest of its prompt
    # to fit beside a chunk in one batch, or after the abort).
    assert chunks[-1]["meta_info"]["cached_tokens"] >= 256


@pytest.mark.parametrize("algorithm", [None, "EAGLE", "DFLASH"])
def test_chunked_prefill_equals_one_prefill(cyclic_model_dir, reference, head, draft, algorithm):
    """A prompt longer than max_prefill_tokens, in chunks (no cache, so every position is computed
    by a chunk): the same greedy ids, and the same seeded samples (a chunk draws no coins)."""
    prompts = [tokens(60, 300), tokens(61, 150)]
    sampled = dict(temperature=0.8, top_p=0.95, max_new_tokens=24, ignore_eos=True, seed=3)
    want = ids(reference.generate(input_ids=prompts, sampling_params=greedy()))
    want_sampled = ids(reference.generate(input_ids=prompts, sampling_params=sampled))
    with engine(cyclic_model_dir, algorithm, draft if algorithm == "DFLASH" else head, chunked_prefill_size=32,
                max_prefill_tokens=64, disable_radix_cache=True) as eng:
        got = ids(eng.generate(input_ids=prompts, sampling_params=greedy()))
        got_sampled = ids(eng.generate(input_ids=prompts, sampling_params=sampled))
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert got == want
    assert stats["prefill_batches"] >= 2 * (300 // 64)
    if algorithm is None:  # EAGLE's sampling draws its coins per tree: compared with its own plain run below
        assert got_sampled == want_sampled


def test_chunked_eagle_sampling_equals_one_prefill(cyclic_model_dir, head):
    prompts = [tokens(60, 300), tokens(61, 150)]
    sampled = dict(temperature=0.8, top_p=0.95, max_new_tokens=24, ignore_eos=True, seed=3)
    outs = []
    for kw in ({"chunked_prefill_size": -1}, {"chunked_prefill_size": 32, "max_prefill_tokens": 64}):
        with engine(cyclic_model_dir, "EAGLE", head, disable_radix_cache=True, **kw) as eng:
            outs.append(ids(eng.generate(input_ids=prompts, sampling_params=sampled)))
            eng.check_kv_invariant()
    assert outs[0] == outs[1]


def test_flush_cache_and_arguments(cyclic_model_dir):
    with engine(cyclic_model_dir) as eng:
        eng.generate(input_ids=WAVE1, sampling_params=greedy(4))
        assert eng.get_server_info()["radix_cache"]["cached_tokens"] > 0
        freed = eng.flush_cache()
        info = eng.get_server_info()
        assert freed > 0 and info["radix_cache"]["cached_tokens"] == 0
        assert info["kv_free"] == info["kv_pool_size"]
        eng.check_kv_invariant()
    with engine(cyclic_model_dir, disable_radix_cache=True) as eng:
        assert eng.get_server_info()["radix_cache"] == {"enabled": False}
        assert eng.flush_cache() == 0
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        specjet.EngineArgs.from_kwargs(chunked_prefill_size=8, page_size=16)
    with pytest.raises(TypeError, match="disable_radix_cache"):
        specjet.EngineArgs.from_kwargs(disable_radix_cache="yes")


@pytest.mark.parametrize("path", ["torch", "native"])
@pytest.mark.parametrize("algorithm", [None, "NGRAM", "EAGLE"])
def test_requests_sharing_cached_prefix_get_the_ids_of_misses(tiny_model_dir, tmp_path, monkeypatch, algorithm, path):
    """Requests decoding (and verifying trees) together on one cached 600-token prefix get the ids they
    get without the cache. On the torch attention path they attend to it as a cascade (gathered once
    for all of them, its softmax part merged with each one's own); the C++ kernel reads the shared
    slots in place and plans no cascade. A random-weight model, whose outputs follow its attention;
    the default cascade thresholds."""
    from specjet.kernels import attention

    if path == "torch":
        monkeypatch.setattr(attention, "native_attention_available", lambda *args: False)
    elif not attention.native_attention_available():
        pytest.skip("the C++ CPU ops are not built")
    used = []
    real = attention.find_shared_prefixes

    def spy(meta, *args, **kwargs):
        plans = real(meta, *args, **kwargs)
        used.extend(p.rows.numel() for p in plans if meta.max_q == 1 or algorithm is not None)
        return plans

    monkeypatch.setattr(attention, "find_shared_prefixes", spy)
    base = tokens(20, 600)
    prompts = [base + tokens(21 + i, 5 + 3 * i) for i in range(5)]
    head = copy_head(tmp_path, tiny_model_dir, [list(range(10, 40))]) if algorithm == "EAGLE" else None
    outs = {}
    for cache in (True, False):
        used.clear()
        # The CPU's attention paths (the Triton kernel on CUDA plans no cascade).
        with engine(tiny_model_dir, algorithm, head, disable_radix_cache=not cache, dtype="bfloat16",
                    device="cpu") as eng:
            eng.generate(input_ids=prompts[0], sampling_params=greedy(4))
            outs[cache] = ids(eng.generate(input_ids=prompts, sampling_params=greedy(16)))
            eng.check_kv_invariant()
        # the 5 requests' rows (not one request's draft rows) as a cascade: on the torch path only
        assert (max(used, default=0) >= 4) == (cache and path == "torch"), used
    assert outs[True] == outs[False]


@pytest.mark.parametrize("page_size, pool", [(1, 49), (16, 64)])
def test_a_repeat_fits_where_its_first_run_did(cyclic_model_dir, page_size, pool):
    """A request takes less of a cached match than the match holds (its last position is computed again, and with
    prompt logprobs every position from logprob_start_len): it locked the whole match, so those positions were held
    twice for its whole life, and a repeat of a request that had just completed in the pool was aborted
    kv_pool_exhausted. The rest of the match now stays evictable: repeats complete, with the first run's ids."""
    prompt = ([101, 202, 303, 404, 505, 606, 707] * 3)[:20]
    greedy = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    scored = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "return_logprob": True,
              "logprob_start_len": 10}
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=pool, page_size=page_size,
                        disable_guided_drafting=True) as eng:
        outs = [eng.generate(input_ids=prompt, sampling_params=greedy) for _ in range(3)]
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 3
        assert outs[1]["meta_info"]["cached_tokens"] > 0 and outs[1]["output_ids"] == outs[0]["output_ids"]
        assert all(o["output_ids"] == outs[0]["output_ids"] for o in outs)
        logged = [eng.generate(input_ids=prompt, sampling_params=scored) for _ in range(2)]
        assert [o["meta_info"]["finish_reason"]["type"] for o in logged] == ["length"] * 2
        assert logged[1]["meta_info"]["input_token_logprobs"] == logged[0]["meta_info"]["input_token_logprobs"]
        eng.wait_idle()
        eng.check_kv_invariant()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE", "DFLASH"])
def test_a_speculative_engine_completes_where_plain_decoding_does(cyclic_model_dir, head, draft, algorithm, overlap):
    """A speculative request reserved a whole tree's positions near the end of its reply, though its tree is cut to
    the tokens it has left, and a request running alone whose tree and the drafter's scratch no longer fitted beside
    its KV was ended kv_pool_exhausted, in a pool where plain decoding completes it. The reservation now stops at
    the output's end, and such a request verifies its root alone (a plain step's worth) instead: in the smallest pool
    the door admits it to, it completes with plain decoding's ids."""
    prompt = ([101, 202, 303, 404, 505, 606, 707] * 3)[:20]
    greedy = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    kwargs = {"NGRAM": {"speculative_algorithm": "NGRAM"},
              "EAGLE": {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head)},
              "DFLASH": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(draft)}}[algorithm]
    pool = len(prompt) + 30 - 1  # the smallest pool plain decoding completes it in (the last token needs no KV)
    while True:  # ... or the smallest the door admits it to, if larger (a tree and the drafter's scratch)
        with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=pool, disable_radix_cache=True,
                            disable_overlap_schedule=not overlap, **kwargs) as eng:
            try:
                out = eng.generate(input_ids=prompt, sampling_params=greedy)
            except ValueError as error:
                assert "more than the pool holds" in str(error)
                pool += 2
                continue
            eng.wait_idle()
            eng.check_kv_invariant()
        break
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=pool, disable_guided_drafting=True) as eng:
        plain = eng.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
        eng.wait_idle()
        eng.check_kv_invariant()
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["output_ids"] == plain
    assert pool < len(prompt) + 30 + 16  # a pool that cannot hold the whole reply and a full tree
