"""The grammar layer over xgrammar, with the real SmolLM2 tokenizer and the dev set of schemas.

The decoding tests drive the grammar with random logits instead of a model, so that what they
check is the mask alone: whatever the logits, masked sampling must produce text that the
independent oracles (`json` + `jsonschema`, `re.fullmatch`) accept.
"""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr

from specjet.grammar import (
    GrammarBackend,
    GrammarError,
    OutputCheck,
    RequestGrammar,
    allocate_token_bitmask,
    apply_token_bitmask_,
    check_json_output,
    fill_token_bitmasks,
    reachable_required,
)

VOCAB_SIZE = 49152  # SmolLM2's LM head
MAX_TOKENS = 2000

# Dev-set schemas for the random walks: enums, anyOf/oneOf with const, patterns, $ref and
# definitions, a recursive $defs tree, patternProperties, and two large Github_hard schemas.
WALK_SCHEMAS = [
    "agent_01.json",  # tool call, enums
    "agent_05.json",  # parallel tool calls: anyOf, const, patterns, minItems
    "agent_07.json",  # intent routing: anyOf, pattern
    "agent_08.json",  # recursive file tree ($defs + $ref)
    "014_Github_easy.json",  # pattern
    "022_Github_medium.json",  # oneOf, $ref, patternProperties
    "033_Github_hard.json",  # oneOf, const, definitions
    "040_Github_hard.json",  # oneOf, definitions, minItems, 11 kB
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def backend(tokenizer):
    backend = GrammarBackend(tokenizer, VOCAB_SIZE, max_threads=2)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def closing_bias(backend) -> torch.Tensor:
    """+6 on the stop tokens and on tokens containing `"`, `,`, `]` or `}`.

    Uniformly random logits would almost never pick the one token that closes a string among
    ~49k that continue it; this fixed bias (a function of the vocabulary only, not of the grammar
    state) makes random walks end within a few hundred tokens. The mask still decides legality.
    """
    bias = torch.zeros(VOCAB_SIZE)
    for token_id, text in enumerate(backend.tokenizer_info.decoded_vocab):
        if any(c in text for c in (b'"', b",", b"]", b"}")):
            bias[token_id] = 6.0
    bias[backend.tokenizer_info.stop_token_ids] = 6.0
    return bias


def random_walk(grammar: RequestGrammar, bias: torch.Tensor, seed: int) -> list[int]:
    """Sample from masked random logits until the grammar terminates; the token ids taken."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_token_bitmask(1, VOCAB_SIZE)
    token_ids = []
    while not grammar.is_terminated() and len(token_ids) < MAX_TOKENS:
        logits = torch.randn(1, VOCAB_SIZE, generator=generator) * 2 + bias
        grammar.fill_next_token_bitmask(bitmask, 0)
        apply_token_bitmask_(logits, bitmask)
        token_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert grammar.accept_token(token_id), "a token allowed by the mask was rejected"
        token_ids.append(token_id)
    assert grammar.is_terminated(), f"no stop token after {MAX_TOKENS} tokens"
    return token_ids


def decode(tokenizer, backend, token_ids: list[int]) -> str:
    stop = set(backend.tokenizer_info.stop_token_ids)
    assert token_ids[-1] in stop and not stop & set(token_ids[:-1])
    return tokenizer.decode(token_ids[:-1])


def allowed_tokens(bitmask: torch.Tensor, row: int) -> torch.Tensor:
    """Token ids whose bit is set, decoded here independently of xgrammar."""
    ids = torch.arange(VOCAB_SIZE)
    return ids[(bitmask[row, ids // 32] >> (ids % 32)) & 1 == 1]


def count_compiles(backend, monkeypatch) -> list:
    """The (kind, text) of every compile the backend starts from now on."""
    compiles = []
    real_compile = backend._compile
    monkeypatch.setattr(backend, "_compile", lambda *key: compiles.append(key) or real_compile(*key))
    return compiles


def test_dev_set_schemas_compile(backend, dev_schemas):
    futures = {e["file"]: backend.compile("json_schema", e["schema"]) for e in dev_schemas}
    failures = {}
    for name, future in futures.items():
        try:
            future.result()
        except GrammarError as error:
            assert str(error).startswith("json_schema could not be compiled: ")
            failures[name] = str(error)
    # The index records which schemas xgrammar 0.2.8 compiles; those must compile here too.
    expected_to_compile = {e["file"] for e in dev_schemas if e["xgrammar_compiles"]}
    assert not expected_to_compile & failures.keys(), failures


@pytest.mark.parametrize("name", WALK_SCHEMAS)
def test_random_walk_is_valid_json_for_schema(name, backend, tokenizer, closing_bias, dev_schemas):
    entry = next(e for e in dev_schemas if e["file"] == name)
    grammar = RequestGrammar(backend.compile("json_schema", entry["schema"]).result())
    text = decode(tokenizer, backend, random_walk(grammar, closing_bias, seed=0))
    validator = getattr(jsonschema, f"{entry['draft']}Validator")
    errors = list(validator(entry["schema"]).iter_errors(json.loads(text)))
    assert not errors, [e.message for e in errors]


@pytest.mark.parametrize(
    "pattern",
    [r"[a-z]{3,8}@example\.(com|org)", r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no|maybe)( because [a-z ]{1,20})?"],
)
def test_random_walk_matches_regex(pattern, backend, tokenizer, closing_bias):
    grammar = RequestGrammar(backend.compile("regex", pattern).result())
    for seed in range(3):
        grammar.reset()
        text = decode(tokenizer, backend, random_walk(grammar, closing_bias, seed))
        assert re.fullmatch(pattern, text), text


def test_builtin_json_and_ebnf(backend, tokenizer, closing_bias):
    grammar = RequestGrammar(backend.compile("json").result())
    json.loads(decode(tokenizer, backend, random_walk(grammar, closing_bias, seed=1)))

    ebnf = 'root ::= "answer: " ("yes" | "no")'
    grammar = RequestGrammar(backend.compile("ebnf", ebnf).result())
    text = decode(tokenizer, backend, random_walk(grammar, closing_bias, seed=1))
    assert text in ("answer: yes", "answer: no")


def test_invalid_json_schema_string(backend):
    future = backend.compile("json_schema", '{"type": "object" "properties": {}}')
    with pytest.raises(GrammarError, match=r"^invalid json_schema: Expecting ',' delimiter: line 1 column 19$"):
        future.result()


def test_check_spec_parses_a_regex_or_ebnf_as_its_compile_does(backend, monkeypatch):
    """The door's check: a regex or EBNF grammar xgrammar cannot parse raises with the compile's message, without a
    compile; one it parses passes. A JSON schema xgrammar refuses passes the door (its conversion can take seconds:
    the compile's time limit bounds it) and fails at the compile."""
    compiles = count_compiles(backend, monkeypatch)
    bad = [("regex", "a(b", "regex could not be parsed: .*parenthesis is not closed"),
           ("ebnf", "root ::= value", 'ebnf could not be parsed: .*Rule "value" is not defined'),
           ("ebnf", 'root ::= "a', "ebnf could not be parsed: .*Expect \"")]
    for kind, spec, words in bad:
        with pytest.raises(GrammarError, match=words):
            backend.check_spec(kind, spec)
    assert compiles == []
    for kind, spec, words in bad:
        with pytest.raises(GrammarError, match=words):  # the compile says the same
            backend.compile(kind, spec).result()
    backend.check_spec("json_schema", {"type": "foo"})
    with pytest.raises(GrammarError, match='json_schema could not be compiled: Unsupported type "foo"'):
        backend.compile("json_schema", {"type": "foo"}).result()
    for kind, spec in [("regex", "(yes|no)"), ("ebnf", 'root ::= "a" | "b"')]:
        backend.check_spec(kind, spec)
        assert isinstance(backend.compile(kind, spec).result(), xgr.CompiledGrammar)
    parses = []
    real_parse = backend._parse
    monkeypatch.setattr(backend, "_parse", lambda *key: parses.append(key) or real_parse(*key))
    backend.check_spec("regex", "(yes|no)")  # compiled already: neither parsed nor compiled again
    backend.check_spec("regex", "(yes|no|maybe)")
    assert parses == [("regex", "(yes|no|maybe)")] and len(compiles) == 6


def test_an_ebnf_token_budget_is_refused_at_the_door(backend, tokenizer):
    """xgrammar enforces ``[max_tokens=N]`` through what its mask fills left: after fills along the path to a state
    past the budget its forced text is longer than a search from the same state without them (``h!`` against ``h``
    below), and a draft tree's walk accepts without fills, so a budgeted grammar cannot be decoded speculatively as plainly. It
    is refused with the rule named; the same rule without the budget, and a char budget, compile."""
    budgeted = 'root ::= r "gh!"\nr[max_tokens=2] ::= "abcdef" | "abcdefgh"'
    # What the refusal rests on, in xgrammar itself: the same state, two forced texts.
    compiled = xgr.GrammarCompiler(backend.tokenizer_info).compile_grammar(budgeted)
    filled, unfilled = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
    for piece in ("ab", "cd", "ef", "g"):  # a fill before every token (and after the last) on one, as decoding does
        filled.fill_next_token_bitmask(allocate_token_bitmask(1, VOCAB_SIZE))
        (token,) = tokenizer.encode(piece, add_special_tokens=False)
        assert filled.accept_token(token) and unfilled.accept_token(token)
    filled.fill_next_token_bitmask(allocate_token_bitmask(1, VOCAB_SIZE))
    assert (filled.find_jump_forward_string(), unfilled.find_jump_forward_string()) == ("h!", "h")

    for spec in (budgeted, 'root ::= r\nr[max_tokens=5] ::= "a" other\nother ::= "b"'):
        with pytest.raises(GrammarError, match=r"^ebnf rule budgets in tokens are not supported \(\[max_tokens=\.\.\.\] on r\)"):
            backend.check_spec("ebnf", spec)
        with pytest.raises(GrammarError, match=r"max_tokens"):
            backend.compile("ebnf", spec).result()
    for spec in (budgeted.replace("[max_tokens=2]", ""), budgeted.replace("max_tokens", "max_chars")):
        backend.check_spec("ebnf", spec)
        assert isinstance(backend.compile("ebnf", spec).result(), xgr.CompiledGrammar)


def test_unsupported_schema_bad_regex_and_unknown_kind(backend):
    with pytest.raises(GrammarError, match=r'^json_schema could not be compiled: Unsupported type "foo"'):
        backend.compile("json_schema", {"type": "foo"}).result()
    with pytest.raises(GrammarError, match=r"^regex could not be parsed: .*parenthesis is not closed"):
        backend.compile("regex", "a(b").result()
    with pytest.raises(GrammarError, match=r"^ebnf could not be parsed: .*Rule \"value\" is not defined"):
        backend.compile("ebnf", "root ::= value").result()
    with pytest.raises(GrammarError, match=r"^unsupported grammar kind 'foo'"):
        backend.compile("foo", "x").result()


def test_failed_compile_is_not_cached(backend, monkeypatch):
    compiles = count_compiles(backend, monkeypatch)
    for _ in range(2):
        with pytest.raises(GrammarError):
            backend.compile("regex", "a(b").result()
    assert compiles == [("regex", "a(b")] * 2


def test_schema_that_strict_mode_cannot_express_still_compiles(backend, tokenizer):
    # Strict mode forbids unlisted properties, so it cannot satisfy minProperties here; the
    # backend falls back to strict_mode=False, which still enforces minProperties.
    grammar = RequestGrammar(backend.compile("json_schema", {"type": "object", "minProperties": 1}).result())
    ids = tokenizer.encode('{"a": 1}', add_special_tokens=False)
    assert grammar.accept_tokens(ids) == len(ids)
    assert grammar.accept_token(backend.tokenizer_info.stop_token_ids[0])
    grammar.reset()
    ids = tokenizer.encode("{}", add_special_tokens=False)
    assert grammar.accept_tokens(ids) < len(ids)


def test_same_schema_is_compiled_once(backend, monkeypatch):
    compiles = count_compiles(backend, monkeypatch)
    schema = {"title": "cache-test", "type": "object", "properties": {"n": {"type": "integer"}}}
    as_dict = backend.compile("json_schema", schema)
    as_text = backend.compile("json_schema", json.dumps(schema, indent=2))  # same schema, other layout
    assert as_dict is not as_text  # each request has a future of its own
    assert as_dict.result() is as_text.result() is backend.compile("json_schema", schema).result()
    assert len(compiles) == 1


def test_concurrent_compiles_share_one_compile(backend, monkeypatch):
    compiles = count_compiles(backend, monkeypatch)
    schema = {"title": "concurrency-test", "type": "array", "items": {"type": "string", "maxLength": 5}}
    barrier = threading.Barrier(8)
    futures = []

    def request():
        barrier.wait()
        futures.append(backend.compile("json_schema", schema))

    threads = [threading.Thread(target=request) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(f.result()) for f in futures}) == 1
    assert len(compiles) == 1


def test_property_order_is_part_of_the_cache_key(backend, tokenizer):
    # xgrammar emits properties in schema order, so reordering them is a different grammar.
    integer = {"type": "integer"}
    ab = {"type": "object", "properties": {"a": integer, "b": integer}, "required": ["a", "b"]}
    ba = {"type": "object", "properties": {"b": integer, "a": integer}, "required": ["a", "b"]}
    for schema, text in ((ab, '{"a": 1, "b": 2}'), (ba, '{"b": 1, "a": 2}')):
        grammar = RequestGrammar(backend.compile("json_schema", schema).result())
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert grammar.accept_tokens(ids) == len(ids)


# A character below U+0100 that xgrammar escapes, before a hex digit: printed "\\xfcb...", which xgrammar's parser reads
# back as one character U+FCB... (specjet/grammar/ebnf_text.py). The last holds a control character (JSON-escaped).
_ESCAPED_BEFORE_HEX = ["über", "Größe", "España", "café", "ÿf", "a\u0001b"]


@pytest.mark.parametrize("kind", ["enum", "const", "property", "regex", "ebnf"])
def test_latin1_letters_before_hex_digits_are_enforced_as_written(kind, backend, tokenizer):
    for word in _ESCAPED_BEFORE_HEX:
        if kind == "enum":
            spec, text = {"enum": [word, "x"]}, json.dumps(word, ensure_ascii=False)
        elif kind == "const":
            spec, text = {"type": "object", "properties": {"w": {"const": word}}, "required": ["w"]}, None
            text = json.dumps({"w": word}, ensure_ascii=False, separators=(",", ": "))
        elif kind == "property":
            spec = {"type": "object", "properties": {word: {"type": "integer"}}, "required": [word],
                    "additionalProperties": False}
            text = json.dumps({word: 7}, ensure_ascii=False, separators=(",", ": "))
        elif kind == "regex":
            spec, text = re.escape(word), word
        else:
            spec, text = 'root ::= "' + word + '" [0-9]', word + "5"  # the characters themselves, unescaped
        grammar = RequestGrammar(backend.compile("regex" if kind == "regex" else "ebnf" if kind == "ebnf"
                                                 else "json_schema", spec).result())
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert grammar.accept_tokens(ids) == len(ids), (kind, word, text)
        assert grammar.accept_token(grammar.compiled.tokenizer_info.stop_token_ids[0]) and grammar.is_terminated()


def test_accept_tokens_counts_until_first_rejection(backend, tokenizer):
    grammar = RequestGrammar(backend.compile("regex", r"ab[0-9]+").result())
    ids = tokenizer.encode("ab12x3", add_special_tokens=False)
    accepted = grammar.accept_tokens(ids)
    assert tokenizer.decode(ids[:accepted]) == "ab12"
    assert grammar.find_jump_forward_string() == ""


def test_no_token_is_offered_after_the_grammars_end(backend, tokenizer, capfd):
    """Drafts and masks of paths through the stop token offer tokens past the grammar's end: refused
    here, without reaching xgrammar (which logs a warning for each), and the state stays as it was."""
    grammar = RequestGrammar(backend.compile("regex", r"(yes|no)").result())
    stop = grammar.compiled.tokenizer_info.stop_token_ids[0]
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    ids = tokenizer.encode("yes", add_special_tokens=False)
    capfd.readouterr()
    assert grammar.accept_tokens(ids + [stop, newline, stop]) == len(ids) + 1
    assert grammar.is_terminated()
    assert not grammar.accept_token(newline) and not grammar.accept_token(stop)
    assert grammar.accept_tokens([newline]) == 0
    assert "trying to accept new token" not in capfd.readouterr().err
    grammar.rollback(1)  # the stop token: open again, and its end still reachable
    assert not grammar.is_terminated()
    assert grammar.accept_token(stop) and grammar.is_terminated()


def test_rollback_restores_the_state(backend, closing_bias, dev_schemas):
    schema = next(e["schema"] for e in dev_schemas if e["file"] == "agent_05.json")
    compiled = backend.compile("json_schema", schema).result()
    grammar = RequestGrammar(compiled)
    token_ids = random_walk(RequestGrammar(compiled), closing_bias, seed=2)
    masks = allocate_token_bitmask(len(token_ids) + 1, VOCAB_SIZE)
    for step, token_id in enumerate(token_ids):
        grammar.fill_next_token_bitmask(masks, step)
        assert grammar.accept_token(token_id)
    assert grammar.is_terminated()

    for k in (1, 5, len(token_ids)):  # undo the stop token, a few tokens, everything
        grammar.rollback(k)
        after = allocate_token_bitmask(1, VOCAB_SIZE)
        grammar.fill_next_token_bitmask(after, 0)
        step = len(token_ids) - k
        assert torch.equal(after[0], masks[step]), f"rollback({k})"
        assert not grammar.is_terminated()
        assert grammar.accept_tokens(token_ids[step:]) == k


def test_fork_is_independent(backend, tokenizer):
    grammar = RequestGrammar(backend.compile("regex", r"(cat|car)s?").result())
    grammar.accept_tokens(tokenizer.encode("ca", add_special_tokens=False))
    fork = grammar.fork()
    ids = tokenizer.encode("ts", add_special_tokens=False)
    assert fork.accept_tokens(ids) == len(ids)
    before, after = allocate_token_bitmask(2, VOCAB_SIZE), allocate_token_bitmask(1, VOCAB_SIZE)
    grammar.fill_next_token_bitmask(before, 0)
    fork.fill_next_token_bitmask(before, 1)
    assert not torch.equal(before[0], before[1])
    grammar.fill_next_token_bitmask(after, 0)
    assert torch.equal(before[0], after[0])


def test_batch_fill_matches_one_by_one(backend, tokenizer):
    """The batched fill writes each grammar's own row at scattered indices and leaves others alone."""
    grammars = [RequestGrammar(backend.compile("regex", pattern).result())
                for pattern in (r"(cat|car)s?", r"[0-9]{2,4}", r"(yes|no)")]
    grammars[0].accept_tokens(tokenizer.encode("ca", add_special_tokens=False))
    rows = [4, 0, 2]
    batched = allocate_token_bitmask(5, VOCAB_SIZE)
    fill_token_bitmasks(grammars, batched, rows)
    expected = allocate_token_bitmask(5, VOCAB_SIZE)
    for grammar, row in zip(grammars, rows):
        grammar.fill_next_token_bitmask(expected, row)
    assert torch.equal(batched, expected)
    assert torch.equal(batched[1], allocate_token_bitmask(1, VOCAB_SIZE)[0])  # untouched: all allowed
    assert not torch.equal(batched[0], batched[4])


def test_jump_forward_string(backend):
    schema = {"type": "object", "properties": {"kind": {"const": "tool_call"}}, "required": ["kind"]}
    grammar = RequestGrammar(backend.compile("json_schema", schema).result())
    assert grammar.find_jump_forward_string() == '{"kind": "tool_call"}'


def test_apply_bitmask_leaves_unconstrained_rows_untouched(backend, tokenizer):
    grammar = RequestGrammar(backend.compile("regex", r"[0-9]+").result())
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB_SIZE, generator=generator)
    original = logits.clone()
    bitmask = allocate_token_bitmask(3, VOCAB_SIZE)
    grammar.fill_next_token_bitmask(bitmask, 1)

    apply_token_bitmask_(logits, bitmask, indices=[1])
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    allowed = allowed_tokens(bitmask, 1)
    assert 0 < len(allowed) < VOCAB_SIZE
    assert torch.equal(torch.isfinite(logits[1]).nonzero()[:, 0], allowed)
    assert torch.equal(logits[1, allowed], original[1, allowed])
    assert all(tokenizer.decode([t]).isdigit() for t in allowed.tolist())

    # Without indices an all-ones row (as allocated) masks nothing.
    logits = original.clone()
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    assert torch.isfinite(logits[1]).sum() == len(allowed)

    logits = original.clone()
    apply_token_bitmask_(logits, bitmask, indices=[])
    assert torch.equal(logits, original)


@pytest.mark.filterwarnings("ignore:The bitmask covers only")  # xgrammar's note on the unmasked tail: on purpose here
def test_the_cpu_mask_writes_what_xgrammars_kernel_writes(monkeypatch):
    """``apply_token_bitmask_`` through the C++ op (a word of the mask at a time) against xgrammar's own CPU kernel
    on the same logits: every kind of word (all forbidden, all allowed, mixed), chosen rows, repeated indices,
    masks narrower than the logits (the tail left alone), NaN and inf logits; bad inputs refused."""
    from specjet.kernels import cpu_ops

    ext = cpu_ops.extension()
    if ext is None:
        pytest.skip("the C++ extension is not built")
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 12, 1000
    for width in (32, 30):  # 30 words cover 960 columns: the last 40 stay as they are
        logits = torch.randn(rows, vocab, generator=gen)
        logits[3, 7], logits[4, 100], logits[5, 2] = float("nan"), float("inf"), float("-inf")
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, width), generator=gen, dtype=torch.int64).to(torch.int32)
        bitmask[0] = 0
        bitmask[1] = -1
        bitmask[2, ::2] = 0
        bitmask[2, 1::2] = -1
        for indices in (None, [1, 2, 6, 11], [4, 4, 0], []):
            ours, theirs = logits.clone(), logits.clone()
            apply_token_bitmask_(ours, bitmask, indices=indices)
            xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=indices, backend="cpu")
            assert torch.equal(ours.isnan(), theirs.isnan())
            assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0)), (width, indices)
    with pytest.raises(RuntimeError, match="out of range"):
        ext.apply_token_bitmask_rows(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [2])
    with pytest.raises(RuntimeError, match="float32"):
        ext.apply_token_bitmask_rows(torch.zeros(2, 64, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.int32), [0])
    with pytest.raises(RuntimeError, match="int32"):
        ext.apply_token_bitmask_rows(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), [0])


def test_cache_evicts_least_recently_used_beyond_its_limit(tokenizer):
    backend = GrammarBackend(tokenizer, VOCAB_SIZE, cache_limit_bytes=1)  # room for one grammar
    try:
        first = backend.compile("regex", "[a-z]+").result()
        second = backend.compile("regex", "[0-9]+").result()
        assert backend.compile("regex", "[0-9]+").result() is second
        assert backend.compile("regex", "[a-z]+").result() is not first
    finally:
        backend.shutdown()


# ---------------------------------------------------------------- required names kept reachable

CREDENTIALS_SCHEMA = {  # draft-04, as found in the field: the required names are not listed
    "$schema": "http://json-schema.org/draft-04/schema#",
    "type": "object",
    "properties": {"credentials": {"type": "string"}},
    "required": ["username", "password"],
}


def test_required_names_are_appended_to_properties():
    original = json.loads(json.dumps(CREDENTIALS_SCHEMA))
    rewritten = reachable_required(CREDENTIALS_SCHEMA)
    assert rewritten == {**CREDENTIALS_SCHEMA,
                         "properties": {"credentials": {"type": "string"}, "username": {}, "password": {}}}
    assert list(rewritten["properties"]) == ["credentials", "username", "password"]  # listed ones keep their places
    assert CREDENTIALS_SCHEMA == original  # the input is not changed


def test_required_names_take_the_schema_json_schema_gives_them():
    schema = {
        "required": ["b", "x_1", "c", "b", 7],  # a repeat and a non-name are ignored
        "properties": {"a": {"type": "integer"}},
        "patternProperties": {"^x_": {"type": "number"}, "_1$": {"minimum": 0}},
        "additionalProperties": {"type": "string"},
    }
    assert reachable_required(schema)["properties"] == {
        "a": {"type": "integer"},
        "b": {"type": "string"},  # additionalProperties
        "x_1": {"allOf": [{"type": "number"}, {"minimum": 0}]},  # every matching pattern
        "c": {"type": "string"},
    }
    # No properties at all; additionalProperties absent means any value.
    assert reachable_required({"type": "object", "required": ["a"]}) == {
        "type": "object", "required": ["a"], "properties": {"a": {}}}
    # Absent additionalProperties: unevaluatedProperties stands in for it.
    assert reachable_required({"required": ["a"], "unevaluatedProperties": {"type": "null"}})["properties"] == {
        "a": {"type": "null"}}


def test_names_that_additional_properties_false_forbids_stay_out():
    # Unsatisfiable by JSON Schema itself; listing "a" would make it satisfiable.
    schema = {"properties": {"b": {}}, "additionalProperties": False, "required": ["a", "x"],
              "patternProperties": {"^x$": {"type": "boolean"}}}
    assert reachable_required(schema)["properties"] == {"b": {}, "x": {"type": "boolean"}}
    unsatisfiable = {"properties": {"b": {}}, "additionalProperties": False, "required": ["a"]}
    assert reachable_required(unsatisfiable) == unsatisfiable


def test_every_subschema_is_rewritten_but_data_is_not():
    inner = {"type": "object", "required": ["k"]}
    fixed = {"type": "object", "required": ["k"], "properties": {"k": {}}}
    schema = {
        "properties": {"p": inner},
        "items": inner,
        "prefixItems": [inner],
        "anyOf": [inner, True],
        "oneOf": [inner],
        "allOf": [inner],
        "not": inner,
        "if": inner, "then": inner, "else": inner,
        "$defs": {"d": inner},
        "definitions": {"d": inner},
        "additionalProperties": inner,
        "dependencies": {"p": inner, "q": ["p"]},
        "const": inner, "enum": [inner], "default": inner, "examples": [inner],
    }
    rewritten = reachable_required(schema)
    for key in ("items", "not", "if", "then", "else", "additionalProperties"):
        assert rewritten[key] == fixed, key
    for key in ("prefixItems", "oneOf", "allOf"):
        assert rewritten[key] == [fixed], key
    assert rewritten["anyOf"] == [fixed, True]
    assert rewritten["properties"] == {"p": fixed}
    assert rewritten["$defs"] == rewritten["definitions"] == {"d": fixed}
    assert rewritten["dependencies"] == {"p": fixed, "q": ["p"]}
    assert rewritten["items"] is not inner and inner == {"type": "object", "required": ["k"]}
    for key in ("const", "default"):
        assert rewritten[key] is inner
    assert rewritten["enum"] == rewritten["examples"] == [inner]
    # The tuple form of items (drafts 4 to 2019-09).
    assert reachable_required({"items": [inner, {"type": "string"}]})["items"] == [fixed, {"type": "string"}]


def test_required_names_not_in_properties_are_generated(backend, tokenizer, closing_bias):
    grammar = RequestGrammar(backend.compile("json_schema", CREDENTIALS_SCHEMA).result())
    # The object cannot close before both required names are written.
    ids = tokenizer.encode('{"credentials": "c"', add_special_tokens=False)
    assert grammar.accept_tokens(ids) == len(ids)
    assert grammar.accept_tokens(tokenizer.encode("}", add_special_tokens=False)) == 0
    grammar.reset()
    text = decode(tokenizer, backend, random_walk(grammar, closing_bias, seed=0))
    assert check_json_output(CREDENTIALS_SCHEMA, text) == OutputCheck(True), text


# ---------------------------------------------------------------- output check


PERSON = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name"]})


def test_output_check_valid_and_invalid():
    assert check_json_output(PERSON, '{"name": "Ann", "age": 3}') == OutputCheck(True, None)
    assert check_json_output(json.loads(PERSON), '{"name": "Ann"}') == OutputCheck(True)  # a dict schema too
    assert check_json_output(PERSON, '{"name": "Ann", "age": "3"}') == OutputCheck(
        False, "output does not match the schema at $.age: '3' is not of type 'integer'")
    assert check_json_output(PERSON, '{"age": 3}') == OutputCheck(
        False, "output does not match the schema at $: 'name' is a required property")
    assert check_json_output(PERSON, '{"name": "Ann"') == OutputCheck(
        False, "output is not JSON: Expecting ',' delimiter: line 1 column 15")
    long = check_json_output({"enum": ["x"]}, json.dumps("y" * 1000))
    assert long.valid is False and len(long.message) == 300 and long.message.endswith("...")


def test_output_check_uses_the_schemas_draft():
    # Draft 4's boolean exclusiveMaximum: 5 is out. (Under 2020-12 the schema itself would be invalid.)
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "maximum": 5, "exclusiveMaximum": True}
    assert check_json_output(draft4, "4").valid is True
    assert check_json_output(draft4, "5") == OutputCheck(
        False, "output does not match the schema at $: 5 is greater than or equal to the maximum of 5")
    draft2020 = {"maximum": 5, "exclusiveMaximum": True}
    result = check_json_output(draft2020, "4")
    assert result.valid is None
    assert result.message.startswith("output not checked: the schema is not valid Draft202012: True is not of type")


@pytest.mark.parametrize("schema", [
    {"type": "foo"},  # not a valid schema
    '{"type": ',  # not JSON
    {"$ref": "https://example.com/not-fetched.json"},  # unresolvable (jsonschema does not fetch)
    {"pattern": "(unclosed"},  # a pattern Python's re cannot compile
])
def test_output_check_says_when_it_cannot_check(schema):
    result = check_json_output(schema, '"text"')
    assert result.valid is None and result.message.startswith("output not checked: "), result


def test_output_check_bounds_its_patterns_time():
    """A backtracking pattern xgrammar does not enforce (under "not") on a 40-character output: Python's `re` took
    hours, on the scheduler thread, every request waiting. The check now gives up within its budget and says so."""
    import time

    from specjet.grammar.output_check import PATTERN_BUDGET_S

    schema = {"type": "string", "not": {"pattern": "^(a|aa)+$b"}}
    started = time.perf_counter()
    result = check_json_output(schema, json.dumps("a" * 40))
    # Without the budget the match's time grows ~1.6x a character (the budget is CPU time; a busy machine
    # stretches the wall time around it).
    assert time.perf_counter() - started < PATTERN_BUDGET_S + 5
    assert result.valid is None and result.message.startswith("output not checked: the schema's patterns took more")
    for key in ("patternProperties", "additionalProperties"):  # the keywords that match property names
        nested = {"type": "object", "patternProperties": {"^(a|aa)+$b": {}}, "additionalProperties": False}
        if key == "additionalProperties":
            nested = {"type": "object", "patternProperties": {"^(a|aa)+$b": {}}, "properties": {"x": {}},
                      "additionalProperties": {"type": "integer"}}
        assert check_json_output(nested, json.dumps({"a" * 40: 1})).valid is None, key
    assert check_json_output(schema, '"ab"').valid is True  # a cheap match is checked as before
    # The root reached again through "$ref": "#" with a "$schema" of its own ran jsonschema's stock class, on `re`.
    for draft in ("http://json-schema.org/draft-07/schema#", "https://json-schema.org/draft/2020-12/schema"):
        recursive = {"$schema": draft, "type": "object", "properties": {
            "s": {"type": "string", "not": {"pattern": "^(a|aa)+$b"}}, "child": {"$ref": "#"}}}
        started = time.perf_counter()
        result = check_json_output(recursive, json.dumps({"child": {"child": {"s": "a" * 40}}}))
        assert time.perf_counter() - started < PATTERN_BUDGET_S + 5 and result.valid is None, draft
        assert check_json_output(recursive, json.dumps({"child": {"s": 3}})).valid is False
    nested = {"type": "object", "properties": {"x": {"$schema": "http://json-schema.org/draft-07/schema#"}}}
    assert "below the root" in check_json_output(nested, '{"x": 1}').message


def test_output_check_budget_counts_the_pattern_matches_alone():
    """A long valid output under many cheap patterns: jsonschema's own work on it takes longer than the budget,
    its matches far less; it is checked (the budget counted the whole check's time)."""
    items = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"^v{i}[0-9]*$"}},
                        "required": [f"k{i}"]} for i in range(4)]}
    output = json.dumps([{f"k{i % 4}": f"v{i % 4}{i}"} for i in range(3000)])
    assert check_json_output({"type": "array", "items": items}, output) == OutputCheck(True)


@pytest.mark.parametrize("schema,instances", [
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}-[0-9]+$"}}},
     [{"id": "ab-12"}, {"id": "AB-12"}, {"id": "ab-"}, {}]),
    ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}, "^y": {"type": "string"}},
      "additionalProperties": False},
     [{"x_1": 1}, {"x_1": "1"}, {"yes": "s"}, {"yes": 2}, {"z": 1}, {"z": 1, "w": 2}, {}]),
    ({"type": "object", "properties": {"a": {}}, "patternProperties": {"^b": {}}, "additionalProperties": {"type": "null"}},
     [{"a": 1, "b1": 2}, {"c": None}, {"c": 0}]),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False}, [{"a": 1}, {"a": 1, "b": 2, "c": 3}]),
    ({"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}}, [{"abc": 1}, {"abd": 1}]),
    ({"type": "array", "contains": {"type": "string", "pattern": "^\\d+$"}}, [["12", "x"], ["x"]]),
])
def test_output_check_on_bounded_patterns_agrees_with_jsonschema(schema, instances):
    """The keywords re-run on the bounded patterns give jsonschema's own verdict and message."""
    import jsonschema

    for instance in instances:
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(instance))
        expected = OutputCheck(True) if error is None else OutputCheck(
            False, f"output does not match the schema at {error.json_path}: {error.message}")
        assert check_json_output(schema, json.dumps(instance)) == expected, instance


def test_output_check_refuses_what_it_cannot_bound():
    schema = {"type": "object", "patternProperties": {"^a": {}}, "unevaluatedProperties": False}
    result = check_json_output(schema, '{"a": 1}')
    assert result.valid is None and "unevaluatedProperties" in result.message


def test_bitmask_allows_reads_token_t_at_bit_t_mod_32_of_word_t_div_32():
    """Several rows, token ids in any order and repeated, the first and last bits of words."""
    from specjet.grammar import bitmask_allows

    gen = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 40), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # none allowed
    tokens = torch.cat([torch.tensor([0, 31, 32, 63, 1279, 5, 5]), torch.randint(0, 1280, (200,), generator=gen)])
    allowed = bitmask_allows(bitmask, tokens)
    assert allowed.dtype == torch.bool and allowed.shape == (3, len(tokens))
    for r in range(3):
        for i, t in enumerate(tokens.tolist()):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            assert bool(allowed[r, i]) == bool((word >> (t % 32)) & 1), (r, t)
    assert allowed[1].all() and not allowed[2].any()


def test_bitmask_popcount_counts_every_set_bit_of_a_row():
    from specjet.grammar import bitmask_popcount

    gen = torch.Generator().manual_seed(4)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 17), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1
    bitmask[2] = 0
    expected = [sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in row.tolist()) for row in bitmask]
    assert bitmask_popcount(bitmask).tolist() == expected
    assert expected[1:] == [17 * 32, 0]
