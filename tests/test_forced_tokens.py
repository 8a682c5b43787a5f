"""Forced text in the tokenizer's own tokens (grammar/forced_tokens.py): where a grammar forces text that the
tokenizer splits into two or more tokens, the mask allows only the first of them, in plain decoding's masks and
in every node of a verified draft tree, so every decoding path writes the same tokens. The oracle throughout is
xgrammar's own forced text (``find_jump_forward_string`` on a matcher of the test's) and the tokenizer's
``encode``; the sampled test compares histograms with the exact masked distribution of HF transformers."""
from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

import specjet
from specjet.grammar import RequestGrammar, allocate_token_bitmask, bitmask_popcount
from specjet.spec_v2.grammar_guide import GrammarGuide
from test_spec_grammar import VOCAB_SIZE, backend, check_valid, masked_two_token_tv  # noqa: F401 (a fixture)

# Keys are forced text; the values leave the model a choice (a short string, an enum, a digit).
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "size": {"enum": ["small", "large"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["name", "size", "count"]}


def rule_token(tokenizer, matcher: xgr.GrammarMatcher):
    """The oracle: the first token of the tokenizer's split of xgrammar's forced text, where it splits in two or
    more; else None."""
    text = "" if matcher.is_terminated() else matcher.find_jump_forward_string()
    split = tokenizer.encode(text, add_special_tokens=False) if text else []
    return split[0] if len(split) >= 2 else None


def allowed(bitmask: torch.Tensor, row: int = 0) -> list[int]:
    bits = torch.tensor(bitmask[row].numpy().view("uint32").tolist(), dtype=torch.int64)
    return [w * 32 + b for w in range(bits.shape[0]) for b in range(32) if (int(bits[w]) >> b) & 1]


def test_a_mask_allows_only_the_first_token_of_the_forced_texts_split(backend):
    """A walk through a JSON schema's grammar: at each state the rule's row is the oracle's token alone where it
    names one, else the plain row (a matcher without the rule, in step)."""
    compiled = backend.compile("json_schema", json.dumps(SCHEMA)).result()
    ruled, plain = RequestGrammar(compiled, backend.forced_tokens), RequestGrammar(compiled)
    oracle = xgr.GrammarMatcher(compiled)
    row, plain_row = allocate_token_bitmask(1, VOCAB_SIZE), allocate_token_bitmask(1, VOCAB_SIZE)
    forced = free = spellings = 0
    for _ in range(200):
        if oracle.is_terminated():
            break
        ruled.fill_next_token_bitmask(row, 0)
        plain.fill_next_token_bitmask(plain_row, 0)
        expected = rule_token(backend.tokenizer, oracle)
        if expected is not None:
            assert allowed(row) == [expected]
            spellings += int(bitmask_popcount(plain_row)[0]) > 1  # the model had other spellings of the text
            assert ruled.forced_token() == expected
            token, forced = expected, forced + 1
        else:
            assert torch.equal(row, plain_row) and ruled.forced_token() is None
            # a free choice: the longest legal token (ends the string and the object soon)
            choices = allowed(plain_row)
            token, free = max(choices, key=lambda t: (len(backend.tokenizer.decode([t])), -t)), free + 1
        assert ruled.accept_token(token) and plain.accept_token(token) and oracle.accept_token(token)
    assert oracle.is_terminated() and forced >= 6 and spellings >= 3 and free >= 3, (forced, spellings, free)


def test_the_forced_chain_is_the_rules_tokens_and_tree_rows_follow_the_rule(backend):
    """GrammarGuide's forced chain under the rule is the tokens the rule writes, each the oracle's; in a draft tree,
    the tokenizer's split survives, another spelling of the same forced text is dropped as illegal, and each kept
    node's row is the rule's row of a matcher that took its path."""
    compiled = backend.compile("json_schema", json.dumps(SCHEMA)).result()
    grammar = RequestGrammar(compiled, backend.forced_tokens)
    guide = GrammarGuide(grammar, VOCAB_SIZE, None)
    chain = guide.forced_chain(16)
    oracle = xgr.GrammarMatcher(compiled)
    for token in chain:
        assert rule_token(backend.tokenizer, oracle) == token and oracle.accept_token(token)
    assert rule_token(backend.tokenizer, oracle) is None and len(chain) >= 3  # ends where the model chooses
    assert backend.tokenizer.decode(chain).startswith('{"name')

    split = backend.tokenizer.encode('{"', add_special_tokens=False)
    brace, quote = (backend.tokenizer.encode(c, add_special_tokens=False)[0] for c in '{"')
    assert split == [chain[0]] and brace != chain[0]  # '{"' is one token, '{' then '"' another spelling
    tokens = [0, chain[0], brace, chain[1], quote, chain[2]]
    parents = [-1, 0, 0, 1, 2, 3]
    kept, kept_parents, bitmask = guide.mask_tree(tokens, parents)
    assert kept == [0, chain[0], chain[1], chain[2]] and kept_parents == [-1, 0, 1, 2]
    for i in range(len(kept)):
        fork = RequestGrammar(compiled, backend.forced_tokens)
        assert fork.accept_tokens(chain[:i]) == i
        expected = allocate_token_bitmask(1, VOCAB_SIZE)
        fork.fill_next_token_bitmask(expected, 0)
        assert torch.equal(bitmask[i], expected[0]), i
    assert grammar.accept_tokens([brace, quote]) == 2  # the state is unchanged, and without a mask any spelling goes


def forced_states(tokenizer, compiled, ids) -> tuple[int, int]:
    """(states where the oracle names a token, of them those where ``ids`` took another)."""
    oracle = xgr.GrammarMatcher(compiled)
    states = other = 0
    for token in ids:
        expected = rule_token(tokenizer, oracle)
        if expected is not None:
            states, other = states + 1, other + (token != expected)
        if not oracle.accept_token(token):
            break
    return states, other


PROMPTS = ["a b c a b c a b", "The cat sat on the mat. The cat", "Hello", "1 2 3"]


def test_engines_write_forced_text_in_the_tokenizers_tokens_and_speculation_stays_exact(tiny_model_dir, backend):
    """Greedy under the schema on the random model: every forced state takes the oracle's token, plain and
    speculative alike (the same ids); with ``disable_canonical_forced_text`` the model's own spellings come back."""
    params = {"json_schema": SCHEMA, "temperature": 0, "max_new_tokens": 64}
    compiled = backend.compile("json_schema", json.dumps(SCHEMA)).result()
    outs = {}
    for name, kw in (("plain", dict(disable_guided_drafting=True)), ("guided", {}),
                     ("ngram", dict(speculative_algorithm="NGRAM")),
                     ("off", dict(disable_guided_drafting=True, disable_canonical_forced_text=True))):
        with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, **kw) as eng:
            outs[name] = eng.generate(PROMPTS, [params] * len(PROMPTS))
            eng.check_kv_invariant()
        check_valid(outs[name], [params] * len(PROMPTS))
    ids = {name: [o["output_ids"] for o in out] for name, out in outs.items()}
    assert ids["guided"] == ids["plain"] and ids["ngram"] == ids["plain"]
    assert sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs["ngram"]) > 0
    for out in ids["plain"]:
        states, other = forced_states(backend.tokenizer, compiled, out)
        assert states >= 5 and other == 0, (states, other)
    assert sum(forced_states(backend.tokenizer, compiled, out)[1] for out in ids["off"]) > 0


def test_sampling_after_forced_text_matches_the_masked_target(tiny_model_dir, backend):
    """1000 seeded draws under a regex that forces '{"ab": ' before free letters: the tokens the rule writes come
    first in every draw (where the mask alone let the model spell the text otherwise, '{' then '"'), the next two
    follow the exact grammar-masked top-k distribution after them, and plain decoding, the default engine's guided
    drafts and NGRAM give the same ids draw for draw (each sampled token has its position's coin)."""
    regex = r'\{"ab": ( ?[abc]){2,8}'
    prompt = '{"ab": a b c {"ab": acc cb {"ab": b a'
    compiled = backend.compile("regex", regex).result()
    oracle, ruled = xgr.GrammarMatcher(compiled), []
    while (token := rule_token(backend.tokenizer, oracle)) is not None:
        assert oracle.accept_token(token)
        ruled.append(token)
    assert backend.tokenizer.decode(ruled) == '{"ab":'  # the last token (' ' or ' a' ...) is the model's
    first = allocate_token_bitmask(1, VOCAB_SIZE)
    RequestGrammar(compiled).fill_next_token_bitmask(first, 0)
    assert int(bitmask_popcount(first)[0]) > 1  # the mask alone allows other spellings
    n, k = 1000, len(ruled)
    params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": k + 2, "regex": regex, "seed": s} for s in range(n)]
    outs = {}
    for name, kw in (("plain", dict(disable_guided_drafting=True)), ("guided", {}),
                     ("ngram", dict(speculative_algorithm="NGRAM"))):
        with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=8192, dtype="float32", **kw) as eng:
            prompt_ids = eng.tokenizer(prompt)["input_ids"]
            outs[name] = eng.generate([prompt] * n, params)
            eng.check_kv_invariant()
    ids = {name: [o["output_ids"] for o in out] for name, out in outs.items()}
    assert ids["guided"] == ids["plain"] and ids["ngram"] == ids["plain"]
    assert sum(o["meta_info"]["spec_accept_length"] > 1 for o in outs["ngram"]) > n // 20  # drafts were taken
    assert all(out[:k] == ruled for out in ids["plain"])
    tv = masked_two_token_tv(tiny_model_dir, backend, regex, prompt_ids, outs["plain"], top_k=3)
    assert tv < 0.07, tv


def test_n_gram_branches_keep_to_the_rule_and_a_split_that_does_not_spell_the_text_forces_nothing(backend):
    """``legal_prefix_len`` stops at a token other than the one the rule forces (such a node is pruned at verify,
    and its branch only took the budget of the sure chain); a tokenizer whose split of a text is not that text (a
    SentencePiece "▁" before it) gets no rule: its first token would be illegal, or a lone space where the model
    writes " x"."""
    from specjet.grammar.forced_tokens import ForcedTokens, text_to_ids

    compiled = backend.compile("json_schema", json.dumps(SCHEMA)).result()
    guide = GrammarGuide(RequestGrammar(compiled, backend.forced_tokens), VOCAB_SIZE, None)
    chain = guide.forced_chain(16)
    brace, quote = (backend.tokenizer.encode(c, add_special_tokens=False)[0] for c in '{"')
    assert guide.legal_prefix_len([], chain) == len(chain)
    assert guide.legal_prefix_len([], [brace, quote]) == 0
    assert guide.legal_prefix_len(chain[:1], chain[1:]) == len(chain) - 1
    assert GrammarGuide(RequestGrammar(compiled), VOCAB_SIZE, None).legal_prefix_len([], [brace, quote]) == 2

    split = text_to_ids(backend.tokenizer)
    space = backend.tokenizer.encode(" ", add_special_tokens=False)[0]
    prefixed = ForcedTokens(lambda text: [space] + split(text), backend.token_bytes)
    row, plain_row = allocate_token_bitmask(1, VOCAB_SIZE), allocate_token_bitmask(1, VOCAB_SIZE)
    ruled, plain = RequestGrammar(compiled, prefixed), RequestGrammar(compiled)
    assert ruled.accept_tokens(chain) == plain.accept_tokens(chain) == len(chain)  # '{"name":', before ' "'
    assert xgr.GrammarMatcher(compiled).find_jump_forward_string().startswith('{"name": "')
    ruled.fill_next_token_bitmask(row, 0)
    plain.fill_next_token_bitmask(plain_row, 0)
    assert allowed(plain_row).count(space) == 1  # a lone space is legal here: the prefixed split's first token
    assert torch.equal(row, plain_row) and int(bitmask_popcount(row)[0]) > 1


def test_restrict_row_narrows_only_a_row_that_allows_the_token():
    """``restrict_row``: a row that allows the token becomes that token alone; a row that forbids it (or is too narrow
    to hold it) is left as it was, and the caller is told, so the rule can never force a token the grammar forbids."""
    from specjet.grammar.forced_tokens import restrict_row

    bitmask = torch.zeros(3, 4, dtype=torch.int32)
    bitmask[0] = -1  # every token
    bitmask[1, 1] = 0b1010  # tokens 33 and 35
    bitmask[2] = -1
    before = bitmask.clone()
    assert restrict_row(bitmask, 0, 70) and allowed(bitmask, 0) == [70]
    assert not restrict_row(bitmask, 1, 34) and torch.equal(bitmask[1], before[1])
    assert restrict_row(bitmask, 1, 35) and allowed(bitmask, 1) == [35]
    assert not restrict_row(bitmask, 2, 128) and torch.equal(bitmask[2], before[2])  # past the row's 4 words


def test_the_rule_takes_the_first_token_of_the_whole_forced_text_even_a_long_one(backend):
    """The forced token is the first of the tokenizer's split of the whole forced text (a long key's first token may
    spell many characters: " responsibilities" is one token), also for a forced text of hundreds of characters."""
    tokenizer = backend.tokenizer
    long_value = " " + "x" * 300 + '"'
    for text in (' responsibilities": "', ' representation of the', '"configuration": {"', long_value,
                 ' responsibilities": "' + long_value):
        split = tokenizer.encode(text, add_special_tokens=False)
        assert len(split) >= 2
        assert backend.forced_tokens.first_token(text) == split[0], text
    assert backend.forced_tokens.first_token(" the") is None  # one token: left to the model


# Forced text of every kind: keys, a long const (kilobytes, written in many tokens), an enum's shared prefix, a
# unicode const (tokens that split a character), a regex with a counted repeat.
REMEMBERED_CASES = [
    ("json_schema", json.dumps({"type": "object", "properties": {
        "note": {"const": "remember " * 300 + "the end"}, "tag": {"enum": ["alpha-one", "alpha-two"]},
        "city": {"const": "Zürich, Genève — 東京"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["note", "tag", "city", "n"]})),
    ("json_schema", json.dumps(SCHEMA)),
    ("regex", r"(ab){40}c[de]f{3}"),
]


@pytest.mark.parametrize("kind,spec", REMEMBERED_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_remembered_forced_text_is_xgrammars_search_at_every_state(backend, kind, spec, seed):
    """RequestGrammar remembers the forced text along its path (the rest of it after a token that spells its
    beginning; restored by a rollback) instead of xgrammar's search at every state. At every state of random walks
    (tokens the mask allows, the forced token or not, rollbacks of 1-5 tokens, forks, draft trees walked through
    the rule) its forced text and forced token are a fresh matcher's search, given the same tokens."""
    import random

    compiled = backend.compile(kind, spec).result()
    rng = random.Random(seed)
    grammar = RequestGrammar(compiled, backend.forced_tokens)
    taken: list[int] = []
    row = allocate_token_bitmask(1, VOCAB_SIZE)
    remembered = 0

    def check(g: RequestGrammar, path: list[int]):
        nonlocal remembered
        fresh = xgr.GrammarMatcher(compiled)
        assert all(fresh.accept_token(t) for t in path)
        if fresh.is_terminated():  # (xgrammar refuses a search after the stop token; the rule forces nothing)
            assert g.is_terminated() and g.forced_token() is None
            return
        remembered += g._forced_text is not None
        expected = fresh.find_jump_forward_string()
        assert g.find_jump_forward_string() == expected, path
        assert g.forced_token() == backend.forced_tokens.first_token(expected)

    for _ in range(400):
        check(grammar, taken)
        move = rng.random()
        if (move < 0.15 or grammar.is_terminated()) and taken:
            n = min(len(taken), rng.randint(1, 5))
            grammar.rollback(n)
            del taken[-n:]
        elif move < 0.2:
            fork = grammar.fork()
            check(fork, taken)
            token = fork.forced_token()
            if token is not None:
                assert fork.accept_token(token)
                check(fork, taken + [token])
        elif move < 0.25:  # a draft tree's walk: the rule's restriction at every node, the state kept
            guide = GrammarGuide(grammar, VOCAB_SIZE, None)
            chain = guide.forced_chain(6)
            tokens = [taken[-1] if taken else 0] + chain
            if len(tokens) > 1:
                guide.mask_tree(tokens, [-1] + list(range(len(chain))))
        else:
            grammar.fill_next_token_bitmask(row, 0)
            choices = allowed(row)
            token = grammar.forced_token()
            if token is None or rng.random() < 0.2:  # also a token other than the forced one, where allowed
                token = rng.choice(choices)
            if grammar.accept_token(token):
                taken.append(token)
    assert remembered > 50, remembered  # the walk went through remembered text, not only fresh searches
