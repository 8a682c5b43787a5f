"""Grammars whose forced text is endless or enormous: xgrammar's jump-forward search has no length limit, so a
JSON schema whose object requires a property of its own type made speculation's forced-chain lookup grow a
string until the process ran out of memory (the OOM killer took the whole engine). Now a grammar with no finite
output is refused where it compiles, and a grammar whose forced text is not shown bounded decodes without the
search. The shortest lengths below are counted by hand from each grammar."""
from __future__ import annotations

import math

import pytest
import xgrammar as xgr

import specjet
from robustness_helpers import assert_healthy, bounded
from specjet.grammar import GrammarError, RequestGrammar
from specjet.grammar.forced_text import MAX_FORCED_TEXT_SPAN, grammar_lengths, jump_forward_is_safe
from test_spec_grammar import backend  # noqa: F401  (the default tokenizer's grammar backend, a fixture)

# An object that must hold an object of its own kind: no finite JSON text is an instance.
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
           "$ref": "#/$defs/n"}
# The same kind may also be null: finite instances exist ({"c": null}).
LINKED_LIST = {"$defs": {"n": {"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#/$defs/n"},
                                                                               {"type": "null"}]}},
                               "required": ["c"]}},
               "$ref": "#/$defs/n"}
# A finite output (an integer), but once the model writes "{" the forced text never ends.
ENDLESS_BRANCH = {"$defs": ENDLESS["$defs"], "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/n"}]}


def ebnf_lengths(text: str):
    return grammar_lengths(xgr.Grammar.from_ebnf(text))


def test_shortest_outputs_of_hand_counted_grammars():
    # "ab" + two of x ("c" is shorter than "de") + nothing from the star: 4 bytes; the longest sequence is root's.
    lengths = ebnf_lengths('root ::= "ab" x{2,3} [a-z]*\nx ::= "c" | "de"')
    assert (lengths.shortest_output, lengths.longest_sequence_floor) == (4, 4)
    # Mutual recursion that ends: a is "y" (1), b is a then "z" (2), root is a.
    lengths = ebnf_lengths('root ::= a\na ::= "x" b | "y"\nb ::= a "z"')
    assert lengths.shortest_output == 1 and lengths.has_finite_output
    assert ebnf_lengths('root ::= root "a" | "b"').shortest_output == 1  # left recursion with an exit
    for endless in ('root ::= "a" root', 'root ::= a\na ::= "x" b\nb ::= a "z"'):
        lengths = ebnf_lengths(endless)
        assert lengths.shortest_output == math.inf and not lengths.has_finite_output
        assert not lengths.jump_forward_is_bounded


def test_a_chain_of_thousands_of_rules_is_counted_without_recursion():
    rules = [f'r{i} ::= "a" r{i + 1}' for i in range(3000)] + ['r3000 ::= "bc"']
    lengths = grammar_lengths(xgr.Grammar.from_ebnf("\n".join(["root ::= r0"] + rules)))
    assert lengths.shortest_output == 3002


def test_json_schemas_recursion_with_and_without_an_exit():
    endless = grammar_lengths(xgr.Grammar.from_json_schema(_text(ENDLESS)))
    assert not endless.has_finite_output
    linked = grammar_lengths(xgr.Grammar.from_json_schema(_text(LINKED_LIST)))
    assert linked.shortest_output == len('{"c":null}') and linked.jump_forward_is_bounded
    branch = grammar_lengths(xgr.Grammar.from_json_schema(_text(ENDLESS_BRANCH)))
    assert branch.shortest_output == 1 and not branch.jump_forward_is_bounded


def test_a_patterns_inner_repeat_counts_though_the_pattern_can_be_short():
    # "a" is a match, but after "b" a million more are forced. (xgrammar keeps the shorter pattern as one regex
    # atom, whose own text counts as empty toward the shortest output: an undercount refuses nothing.)
    short = grammar_lengths(xgr.Grammar.from_json_schema(_text({"type": "string", "pattern": "^(a|b{1000})$"})))
    long = grammar_lengths(xgr.Grammar.from_json_schema(_text({"type": "string", "pattern": "^(a|b{1000000})$"})))
    assert len('""') <= short.shortest_output <= len('"a"') and long.shortest_output == len('"a"')
    assert short.jump_forward_is_bounded and not long.jump_forward_is_bounded
    assert long.longest_sequence_floor > MAX_FORCED_TEXT_SPAN


@pytest.mark.parametrize("kind, spec", [("json_schema", ENDLESS), ("ebnf", 'root ::= "a" root'),
                                        ("ebnf", 'root ::= a\na ::= "x" b\nb ::= a "z"')])
def test_a_grammar_with_no_finite_output_is_refused_at_compile(backend, kind, spec):
    with pytest.raises(GrammarError, match=f"^{kind} admits no finite output"):
        backend.compile(kind, spec).result()


def test_the_search_runs_only_where_it_is_bounded(backend):
    bounded_grammar = RequestGrammar(backend.compile("json_schema", LINKED_LIST).result())
    assert jump_forward_is_safe(bounded_grammar.compiled)
    assert bounded_grammar.find_jump_forward_string() == '{"c": '
    for kind, spec in (("json_schema", ENDLESS_BRANCH), ("regex", "a{1000000}")):
        compiled = backend.compile(kind, spec).result()
        assert not jump_forward_is_safe(compiled)
        grammar = RequestGrammar(compiled)
        assert grammar.accept_tokens(backend.tokenizer.encode("{" if kind == "json_schema" else "a")) == 1
        assert grammar.find_jump_forward_string() == ""  # xgrammar's search would not end (or not soon)
    assert jump_forward_is_safe(backend.compile("json").result())
    # A grammar compiled elsewhere was never checked: no search.
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b"])).compile_grammar('root ::= "ab"')
    assert not jump_forward_is_safe(compiled)


def test_every_dev_set_schema_is_read_and_keeps_its_forced_text(backend, dev_schemas):
    """The installed xgrammar's grammar layout is one `grammar_lengths` reads (else every grammar would lose its
    forced text), and no dev-set schema loses it."""
    for entry in dev_schemas:
        if not entry["xgrammar_compiles"]:
            continue
        compiled = backend.compile("json_schema", entry["schema"]).result()
        assert jump_forward_is_safe(compiled), entry["file"]


def test_an_endless_forced_text_decodes_beside_an_innocent_request(tiny_model_dir):
    """The default engine drafts a constrained request's forced text (guided drafting); on ENDLESS_BRANCH that
    lookup ran out of memory. Now the request decodes to its budget, its neighbour's output is its output alone,
    and the engine is healthy."""
    innocent = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096) as engine:
        alone = engine.generate("The cat sat on", innocent)
        prefix = '{"c": {"c": '
        outs = bounded(engine.generate, ["The cat sat on", "x"],
                       [innocent, {"temperature": 0, "max_new_tokens": 24, "json_schema": ENDLESS_BRANCH,
                                   "logit_bias": {str(t): 100.0 for t in engine.tokenizer.encode(
                                       "{", add_special_tokens=False)}}])
        with pytest.raises(ValueError, match="admits no finite output"):  # refused at the door (its compile's wait)
            engine.generate(["x", "The cat sat on"], [{"max_new_tokens": 4, "json_schema": ENDLESS}, innocent])
        engine.scheduler.grammar_backend.door_compile_wait_s = 0.0  # refused by the compile alone: an abort
        refused, beside = engine.generate(["x", "The cat sat on"],
                                          [{"max_new_tokens": 4, "json_schema": ENDLESS}, innocent])
        assert_healthy(engine)
    assert beside["output_ids"] == alone["output_ids"]
    assert outs[0]["output_ids"] == alone["output_ids"]
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "length"
    assert outs[1]["text"].startswith(prefix)
    assert refused["meta_info"]["finish_reason"]["type"] == "abort"
    assert "admits no finite output" in refused["meta_info"]["finish_reason"]["message"]


def _text(schema) -> str:
    import json

    return json.dumps(schema)


# About 1,000 characters the grammar forces after "yes, " or "no, ": far more than a draft's tokens can hold.
LONG_FORCED = "(yes|no), " + "the forced text goes on " * 40 + "[a-c]{2}"


def test_a_long_forced_text_is_tokenized_only_as_far_as_a_draft_reaches(backend):
    """Only the head of a long forced text is tokenized; the chain is still the tokenizer's own split of it."""
    from specjet.spec_v2.grammar_guide import GrammarGuide

    grammar = RequestGrammar(backend.compile("regex", LONG_FORCED).result())
    tokenize = lambda text: backend.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert grammar.accept_tokens(tokenize("yes")) == 1
    chain = GrammarGuide(grammar, 49152, tokenize).forced_chain(8)
    assert chain == tokenize(", the forced text goes on the forced text goes on")[:8]


def test_drafting_a_long_forced_text_gives_plain_decodings_ids(tiny_model_dir, plain):
    params = [{"temperature": 0, "max_new_tokens": 80, "regex": LONG_FORCED},
              {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}]
    prompts = ["x", "The cat sat on"]
    expected = [o["output_ids"] for o in plain.generate(prompts, params)]
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, speculative_algorithm="NGRAM") as eng:
        outs = eng.generate(prompts, params)
        assert_healthy(eng)
    assert [o["output_ids"] for o in outs] == expected
    assert outs[0]["meta_info"]["spec_accept_length"] > 1.3  # forced chains drafted (the random model splits some)
