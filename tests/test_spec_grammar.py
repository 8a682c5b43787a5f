"""Speculation under a grammar is lossless: per-node grammar masks of a draft tree against walking
each path with a forked matcher; exact token ids of speculative constrained decoding (EAGLE and
NGRAM, grammar-aware drafting on and off) against the plain constrained path, for JSON schemas,
regexes and mixed batches; the masked target distribution under sampling; the KV invariant after
every workload; every output valid under its schema (jsonschema, re.fullmatch). Tiny random model;
the e2e test shows accept lengths above 1 on the real model."""
from __future__ import annotations

import collections
import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

import specjet
from specjet.grammar import GrammarBackend, RequestGrammar, allocate_token_bitmask
from specjet.spec_v2.grammar_guide import ChainWalk, GrammarGuide
from test_spec_eagle import random_head

VOCAB_SIZE = 49152

# Bounded: enums, a capped integer, a short string, a short array, so that even a random model's
# output ends (and can be validated) within the token budget. The keys are forced text, which
# grammar-aware drafting turns into chains.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "label": {"type": "string", "maxLength": 6},
    },
    "required": ["color", "n", "tags", "ok", "label"],
}
REGEX = r"(hello world, ){2}[a-c ]{3,12}"
PROMPTS = ["a b c a b c a b", "The cat sat on the mat. The cat", "1 2 3 4 1 2", "Hello"]


def greedy(n, **extra):
    return dict({"temperature": 0, "max_new_tokens": n}, **extra)


# Constrained and unconstrained requests in one batch.
MIXED = [greedy(64, json_schema=SCHEMA), greedy(40, regex=REGEX), greedy(30, ignore_eos=True),
         greedy(64, json_schema=SCHEMA)]


def check_valid(outs, params):
    for out, p in zip(outs, params):
        if "json_schema" in p:
            jsonschema.validate(json.loads(out["text"]), p["json_schema"])
        if "regex" in p:
            assert re.fullmatch(p["regex"], out["text"]), out["text"]


# ------------------------------------------------------------------ grammar units
@pytest.fixture(scope="module")
def backend(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    backend = GrammarBackend(tokenizer, VOCAB_SIZE)
    backend.tokenizer = tokenizer
    yield backend
    backend.shutdown()


def ids(backend, text):
    return backend.tokenizer.encode(text, add_special_tokens=False)


def test_tree_masks_equal_walking_each_path_with_a_forked_matcher(backend):
    grammar = RequestGrammar(backend.compile("regex", "(abc|abd|x)yz").result())
    (a,), (b,), (c,), (d,), (x,), (y,), (z,) = (ids(backend, t) for t in "abcdxyz")
    stop = backend.tokenizer_info.stop_token_ids[0]
    # root -> a -> b -> {c -> y, d}; root -> x -> y -> z -> stop; root -> c (illegal) -> y
    tokens = [0, a, x, c, b, y, y, c, d, z, stop, y]
    parents = [-1, 0, 0, 0, 1, 2, 3, 4, 4, 5, 9, 7]
    before = allocate_token_bitmask(1, VOCAB_SIZE)
    grammar.fill_next_token_bitmask(before, 0)

    masked, kept_parents, bitmask = GrammarGuide(grammar, VOCAB_SIZE).mask_tree(tokens, parents)

    assert masked == [0, a, x, b, y, c, d, z, stop, y]  # the illegal 'c' and its child are gone
    assert kept_parents == [-1, 0, 0, 1, 2, 3, 3, 4, 7, 5]
    for i, token in enumerate(masked):  # oracle: replay the path root..i on a fork, then fill
        path, node = [], i
        while node > 0:
            path.append(masked[node])
            node = kept_parents[node]
        fork = grammar.fork()
        assert fork.accept_tokens(path[::-1]) == len(path)
        expected = allocate_token_bitmask(1, VOCAB_SIZE)
        if fork.is_terminated():  # after the stop token nothing is masked (the scheduler stops there)
            expected.fill_(-1)
        else:
            fork.fill_next_token_bitmask(expected, 0)
        assert torch.equal(bitmask[i], expected[0]), (i, token)
    # The matcher's state is what it was: same mask, and it still takes a legal path.
    after = allocate_token_bitmask(1, VOCAB_SIZE)
    grammar.fill_next_token_bitmask(after, 0)
    assert torch.equal(before, after)
    assert grammar.accept_tokens([x, y, z]) == 3


def test_forced_chain_and_draft_masks_leave_the_state_alone(backend):
    schema = {"type": "object", "properties": {"name": {"enum": ["web_search", "translate"]}}, "required": ["name"]}
    grammar = RequestGrammar(backend.compile("json_schema", schema).result())
    guide = GrammarGuide(grammar, VOCAB_SIZE, lambda text: ids(backend, text))
    forced = grammar.find_jump_forward_string()
    assert forced == '{"name": "'
    chain = guide.forced_chain(16)
    # The forced text's tokens but the last, which may merge with the enum value that follows.
    assert chain == ids(backend, forced)[:-1] and chain
    assert guide.forced_chain(1) == chain[:1]
    masks = guide.masks_after([chain, chain + [ids(backend, "}")[0]]])
    assert masks[0].any() and not masks[1].any()  # an illegal path allows nothing after it
    assert guide.legal_prefix_len(chain, ids(backend, ' "web_search"}') + [0]) == len(ids(backend, ' "web_search"}'))
    assert grammar.find_jump_forward_string() == forced  # nothing was left accepted
    assert grammar.accept_tokens(ids(backend, forced)) == len(ids(backend, forced))


def test_a_walks_forced_chain_is_the_forced_chain_of_a_matcher_that_took_its_path(backend):
    schema = {"type": "object", "properties": {"name": {"enum": ["web_search", "translate"]}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    grammar = RequestGrammar(backend.compile("json_schema", schema).result())
    guide = GrammarGuide(grammar, VOCAB_SIZE, lambda text: ids(backend, text))
    before = grammar.find_jump_forward_string()
    for text in ('{"name": "web', '{"name": "translate"', '{"name": "translate", "n": 4'):
        path = ids(backend, text)
        fork = grammar.fork()
        assert fork.accept_tokens(path) == len(path)
        expected = GrammarGuide(fork, VOCAB_SIZE, lambda t: ids(backend, t)).forced_chain(16)
        with guide.walk(path) as walk:
            assert walk.forced_chain(16) == expected, text
            assert walk.forced_chain(2) == expected[:2]
        assert grammar.find_jump_forward_string() == before  # the path was rolled back
    # '{"name": "translate"' forces ', "n": ' (all but its last token, which may merge with the digits)
    with guide.walk(ids(backend, '{"name": "translate"')) as walk:
        assert backend.tokenizer.decode(walk.forced_chain(16)) in (', "n":', ', "n')
    with guide.walk(ids(backend, '{"nope')) as walk:
        assert walk.forced_chain(16) == []  # an illegal path forces nothing


def test_a_chain_walk_gives_masks_after_and_forced_chain_of_each_prefix(backend):
    """The incremental walk grammar-aware DFLASH drafting takes along its chain: after each token its
    mask is ``masks_after([prefix])``'s and its forced text that of a matcher that took the prefix;
    past an illegal token both are empty; the grammar is left as it was."""
    schema = {"type": "object", "properties": {"name": {"enum": ["web_search", "translate"]}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    grammar = RequestGrammar(backend.compile("json_schema", schema).result())
    guide = GrammarGuide(grammar, VOCAB_SIZE, lambda text: ids(backend, text))
    before = guide.masks_after([[]])
    chain = ids(backend, '{"name": "translate", "n": 42}')
    start = ids(backend, '{"name')
    assert chain[:len(start)] == start
    # (The walk holds the request's matcher: what to expect is worked out before it starts.)

    def forced_after(prefix):
        fork = grammar.fork()
        assert fork.accept_tokens(prefix) == len(prefix)
        return GrammarGuide(fork, VOCAB_SIZE, lambda t: ids(backend, t)).forced_chain(16)

    expected = [(guide.masks_after([chain[:i]]), forced_after(chain[:i])) for i in range(len(start), len(chain) + 1)]
    assert any(forced for _, forced in expected) and all(mask.any() for mask, _ in expected[:-1])
    with guide.walk(start) as walk:
        for i, (mask, forced) in zip(range(len(start), len(chain) + 1), expected):
            assert torch.equal(walk.mask(), mask), i
            assert walk.forced_chain(16) == forced, i
            if i < len(chain):
                walk.take(chain[i])
        walk.take(ids(backend, "x")[0])  # after the object's end nothing is legal
        assert not walk.mask().any() and walk.forced_chain(16) == []
    assert torch.equal(guide.masks_after([[]]), before)
    with guide.walk(ids(backend, '{"nope')) as walk:  # an illegal start
        assert not walk.mask().any() and walk.forced_chain(16) == []
    assert torch.equal(guide.masks_after([[]]), before)


def test_forced_text_is_split_as_the_tokenizer_splits_it(default_model_dir):
    """The speculator tokenizes forced text through the fast tokenizer's backend: the ids of
    ``tokenizer.encode`` without special tokens, for the kinds of text a JSON grammar forces."""
    from transformers import AutoTokenizer

    from specjet.grammar.forced_tokens import text_to_ids

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    assert getattr(tokenizer, "backend_tokenizer", None) is not None
    split = text_to_ids(tokenizer)
    long_text = '"' + "abc, " * 80 + '"'  # past the cached length: split every time
    for text in ('{"name": "', '", "n": ', '"}\n', " true", "\u00e9t\u00e9 \u2014 ok", "   ", "<|im_end|>", long_text):
        assert split(text) == tokenizer.encode(text, add_special_tokens=False), text
    # Splits are cached (forced texts repeat): a second call gives the same ids, as a list of its own.
    first = split('", "n": ')
    first.append(-1)
    assert split('", "n": ') == tokenizer.encode('", "n": ', add_special_tokens=False)


def test_a_grammars_stop_tokens_are_looked_up_once_for_it_and_its_forks(backend, monkeypatch):
    """The scheduler forks a request's grammar every speculative iteration; xgrammar builds its tokenizer
    info anew on every access, so the stop tokens are read once and shared with the forks."""
    compiled = backend.compile("regex", "(abc|x)yz").result()
    grammar = RequestGrammar(compiled)
    fork = grammar.fork()
    assert fork.stop_token_ids() == tuple(backend.tokenizer_info.stop_token_ids)
    reads = []
    monkeypatch.setattr(type(compiled), "tokenizer_info", property(lambda self: reads.append(1)), raising=False)
    assert grammar.stop_token_ids() == fork.fork().stop_token_ids() == tuple(backend.tokenizer_info.stop_token_ids)
    assert not reads


# ------------------------------------------------------------------ engines (tiny model)
@pytest.fixture(scope="module")
def expected(plain):
    outs = plain.generate(PROMPTS, MIXED)
    check_valid(outs, MIXED)
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def head(tmp_path_factory, tiny_model_dir):
    return random_head(tmp_path_factory.mktemp("grammar-head"), tiny_model_dir)


def spec_engine(tiny_model_dir, algorithm, head=None, **kw):
    kw.setdefault("max_total_tokens", 4096)
    if algorithm == "EAGLE":
        kw.setdefault("speculative_hybrid_ngram_tokens", 0)  # the head's own trees, unless a test merges n-grams in
    if head is not None:
        kw["speculative_draft_model_path"] = str(head)
    return specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm=algorithm, **kw)


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE", "EAGLE+NGRAM"])
@pytest.mark.parametrize("aware", [True, False])
def test_greedy_constrained_equals_plain(tiny_model_dir, head, expected, algorithm, aware):
    extra = {"speculative_eagle_topk": 2, "speculative_num_steps": 3, "speculative_num_draft_tokens": 8} \
        if algorithm.startswith("EAGLE") else {}
    if algorithm == "EAGLE+NGRAM":  # EAGLE trees with the n-gram continuation merged in
        algorithm, extra["speculative_hybrid_ngram_tokens"] = "EAGLE", 4
    with spec_engine(tiny_model_dir, algorithm, head if algorithm == "EAGLE" else None,
                     speculative_grammar_aware=aware, **extra) as eng:
        outs = eng.generate(PROMPTS, MIXED)  # one mixed batch
        single = eng.generate(PROMPTS[0], MIXED[0])
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
    assert [o["output_ids"] for o in outs] == expected
    assert single["output_ids"] == expected[0]
    check_valid(outs, MIXED)
    constrained = [o for o, p in zip(outs, MIXED) if "json_schema" in p or "regex" in p]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in constrained)
    if aware:  # forced keys become chains: constrained requests commit several tokens per verify
        assert stats["spec_accepted_tokens"] > 1.3 * stats["spec_verify_ct"]
        assert all(o["meta_info"]["spec_accept_length"] > 1.3 for o in constrained if o["meta_info"]["spec_verify_ct"])


def test_only_the_scheduler_thread_touches_a_requests_matcher(tiny_model_dir, head, expected, monkeypatch):
    """The overlap loop's thread boundary holds for grammar state: the request's own matcher is advanced
    and read by the scheduler thread alone, and speculation, on the compute thread, drafts and verifies
    against a fork of it (overlapped with the host's work), with the same tokens as plain decoding."""
    import threading

    calls = []  # (on a fork?, thread, method)
    real_fork = RequestGrammar.fork

    def fork(self):
        forked = real_fork(self)
        forked.is_fork = True
        return forked

    for name in ("accept_token", "accept_tokens", "rollback", "fill_next_token_bitmask", "fill_draft_tree_bitmask",
                 "is_terminated", "find_jump_forward_string"):
        def spy(self, *args, _real=getattr(RequestGrammar, name), _name=name, **kwargs):
            calls.append((getattr(self, "is_fork", False), threading.current_thread().name, _name))
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(RequestGrammar, name, spy)
    monkeypatch.setattr(RequestGrammar, "fork", fork)
    with spec_engine(tiny_model_dir, "EAGLE", head, speculative_eagle_topk=2, speculative_num_steps=3,
                     speculative_num_draft_tokens=8, disable_overlap_schedule=False) as eng:
        # The overlap loop (asked for: the CPU's default is the plain loop, all on the scheduler thread). On
        # the CPU its compute side is a thread of its own; on CUDA it is a stream that the
        # scheduler thread launches work on, so there the forks are the scheduler thread's too.
        compute_thread = "specjet-compute" if eng.worker.device.type == "cpu" else "specjet-scheduler"
        outs = eng.generate(PROMPTS, MIXED)
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == expected
    own = {thread for is_fork, thread, _ in calls if not is_fork}
    forked = {thread for is_fork, thread, _ in calls if is_fork}
    assert own == {"specjet-scheduler"}, own
    assert forked == {compute_thread}, forked
    assert {m for f, _, m in calls if f} >= {"accept_tokens", "fill_draft_tree_bitmask", "rollback"}


def test_page_size_and_tight_budgets(tiny_model_dir, head, plain):
    params = [greedy(n, json_schema=SCHEMA) for n in (1, 2, 5, 9)] + [greedy(40, regex=REGEX)]
    prompts = PROMPTS + PROMPTS[:1]
    ref = [o["output_ids"] for o in plain.generate(prompts, params)]
    with spec_engine(tiny_model_dir, "EAGLE", head, page_size=16, speculative_eagle_topk=4,
                     speculative_num_steps=2, speculative_num_draft_tokens=12) as eng:
        outs = eng.generate(prompts, params)
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == ref


def masked_topk_probs(model, grammar, prompt_ids, prefix, top_k):
    """The target's top-k distribution after prompt + prefix, restricted to what the grammar allows
    after prefix (HF transformers for the logits, a forked xgrammar matcher and xgrammar's kernel for the mask)."""
    fork = grammar.fork()
    assert fork.accept_tokens(prefix) == len(prefix)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + prefix])).logits[0, -1:].float()
    bitmask = allocate_token_bitmask(1, logits.shape[-1])
    fork.fill_next_token_bitmask(bitmask, 0)
    xgr.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")  # xgrammar's own: not the code under test
    vals, idx = logits[0].topk(top_k)
    return dict(zip(idx.tolist(), torch.softmax(vals, -1).tolist()))


@pytest.mark.parametrize("algorithm", ["NGRAM", None])
def test_sampling_under_a_grammar_matches_the_masked_target(tiny_model_dir, backend, algorithm):
    """1000 seeded draws of three tokens with NGRAM, and without speculation (whose constrained requests draft
    NGRAM trees): the (t1, t2) histogram matches the exact grammar-masked top-k distribution (t2 and t3 come from
    tree verification). The prompt holds the pieces this target favours under the regex ("acc", "cb"), so the
    n-gram tree after t1 proposes a t2 that the target samples part of the time: most draws take a draft."""
    regex = r"( ?[abc]){3,8}"
    prompt = "a b c a b c accacc cbacc accacc"
    n = 1000
    with spec_engine(tiny_model_dir, algorithm, dtype="float32") as eng:  # the oracle's dtype
        prompt_ids = eng.tokenizer(prompt)["input_ids"]
        params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "regex": regex, "seed": s} for s in range(n)]
        outs = eng.generate([prompt] * n, params)
        eng.check_kv_invariant()
    assert sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs) > n // 20  # drafts were accepted
    tv = masked_two_token_tv(tiny_model_dir, backend, regex, prompt_ids, outs, top_k=3)
    assert tv < 0.07, tv


def masked_two_token_tv(model_dir, backend, regex, prompt_ids, outs, top_k) -> float:
    """Total variation between the outputs' two tokens after those the forced-text rule writes first (in every
    output: asserted; none where the regex starts with a choice) and the exact grammar-masked top-k distribution of
    the target (HF transformers) after ``prompt_ids`` and them. The masks are the rule's (tests/test_forced_tokens.py
    checks them against xgrammar's forced text and the tokenizer)."""
    from transformers import AutoModelForCausalLM

    grammar = RequestGrammar(backend.compile("regex", regex).result(), backend.forced_tokens)
    ruled = []
    while (token := grammar.forced_token()) is not None:
        grammar.accept_token(token)
        ruled.append(token)
    grammar.rollback(len(ruled))
    k = len(ruled)
    assert all(o["output_ids"][:k] == ruled for o in outs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    exact = {}
    for t1, p1 in masked_topk_probs(model, grammar, prompt_ids, ruled, top_k).items():
        if p1 > 0:  # (a top k past the legal tokens holds masked ones at 0)
            for t2, p2 in masked_topk_probs(model, grammar, prompt_ids, ruled + [t1], top_k).items():
                exact[(t1, t2)] = p1 * p2
    counts = collections.Counter(tuple(o["output_ids"][k:k + 2]) for o in outs)
    n = len(outs)
    return 0.5 * sum(abs(counts.get(key, 0) / n - exact.get(key, 0.0)) for key in set(exact) | set(counts))


# ------------------------------------------------------------------ real model
@pytest.mark.e2e
def test_constrained_requests_speculate_on_the_real_model(dev_schemas):
    """EAGLE with the packaged head: schema requests now commit several tokens per verify, with
    grammar-aware drafting on or off, and give the plain engine's tokens exactly."""
    entries = [e for e in dev_schemas if e["file"] in ("agent_01.json", "022_Github_medium.json")]
    params = [greedy(64, json_schema=e["schema"]) for e in entries]
    with specjet.Engine(max_total_tokens=8192, disable_guided_drafting=True) as eng:
        prompts = [eng.apply_chat_template(e["prompt"]) for e in entries]
        expected = [o["output_ids"] for o in eng.generate(prompts, params)]
    accept = {}
    # The float defaults' tree, given explicitly (a quantized target defaults to one draft token): what
    # is tested is how far grammar-aware drafting carries a tree whose nodes it may spend.
    tree = dict(speculative_num_steps=4, speculative_eagle_topk=4, speculative_num_draft_tokens=12,
                speculative_hybrid_ngram_tokens=14)
    for aware in (True, False):
        with specjet.Engine(max_total_tokens=8192, speculative_algorithm="EAGLE",
                            speculative_grammar_aware=aware, **tree) as eng:
            outs = eng.generate(prompts, params)
            eng.check_kv_invariant()
            accept[aware] = eng.get_server_info()["stats"]["spec_accept_length"]
        assert [o["output_ids"] for o in outs] == expected
        for out, e in zip(outs, entries):
            if out["meta_info"]["finish_reason"]["type"] == "stop":
                jsonschema.validate(json.loads(out["text"]), e["schema"])
    assert accept[False] > 1.5 and accept[True] > 2.5, accept


@pytest.mark.e2e
def test_dflash_with_float_weights_runs_past_its_block_on_forced_text_and_stays_exact(dev_schemas, monkeypatch):
    """DFLASH with the packaged draft on float weights (the dtype the CPU picks): under a schema the
    chain takes the grammar's forced text past the block's end (``forced_tail``, on for float targets),
    and the tokens are still plain constrained decoding's, every completed object valid."""
    entries = [e for e in dev_schemas if e["file"] in ("agent_01.json", "022_Github_medium.json")]
    params = [greedy(96, json_schema=e["schema"]) for e in entries]
    with specjet.Engine(max_total_tokens=8192, quantization=None) as eng:
        prompts = [eng.apply_chat_template(e["prompt"]) for e in entries]
        expected = [o["output_ids"] for o in eng.generate(prompts, params)]
        eng.check_kv_invariant()
    tails = []
    real = ChainWalk.forced_chain

    def spy(self, max_len):
        out = real(self, max_len)
        tails.append(len(out))
        return out

    monkeypatch.setattr(ChainWalk, "forced_chain", spy)
    with specjet.Engine(max_total_tokens=8192, quantization=None, speculative_algorithm="DFLASH") as eng:
        assert eng.worker.speculator.cfg.dflash.forced_tail
        outs = eng.generate(prompts, params)
        eng.check_kv_invariant()
    assert [o["output_ids"] for o in outs] == expected
    assert any(n > 0 for n in tails)  # some chain went on past its block
    for out, e in zip(outs, entries):
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(out["text"]), e["schema"])
