"""How long a grammar's outputs must be: whether it has a finite output at all, and whether the text it forces
from any state is short enough for xgrammar's jump-forward search.

xgrammar's `find_jump_forward_string` extends the forced text one byte at a time for as long as the grammar
allows only one next byte, with no length limit. A grammar whose forced text never ends (a JSON schema whose
object requires a property of its own type, an EBNF rule ``root ::= "a" root``) makes that loop grow its
string until the process runs out of memory; one whose forced text is merely enormous (``a{1000000}``) makes
every decode iteration build and tokenize megabytes. Speculation asks for the forced text every iteration
(`spec_v2/grammar_guide.py`), so the engine must know, per grammar, whether the search is safe to run.

The bound used: the shortest text each rule can derive (infinite for a rule that derives no finite text),
found by fixed-point iteration over the grammar's rules. From any matcher state the forced text is a prefix
of every completion, so it is no longer than the shortest completion, which is at most the parse's depth
times the longest "shortest rest" of any sequence in the grammar (`longest_sequence_floor`). When that is
finite and at most `MAX_FORCED_TEXT_SPAN`, the search ends soon; otherwise the request drafts without it.
A grammar whose root derives no finite text has no valid output at all, and is refused where it compiles
(`backend.py`).

The same serialization gives the rules that carry a token budget (`token_budget_rules`), which the backend refuses.

The grammar is read through `Grammar.serialize_json`, whose layout xgrammar versions (``__VERSION__``); an
unknown version or expression type gives `None` (the caller treats the grammar as unsafe for the search).
"""

from __future__ import annotations

import json
import math
import re
import weakref
from dataclasses import dataclass

import xgrammar as xgr

# The longest "shortest rest" of a sequence for which the jump-forward search runs: a JSON object of a
# thousand required properties is ~10 KB; a repeat of a million bytes is not searched (the request still
# decodes under its grammar, drafting without the forced text).
MAX_FORCED_TEXT_SPAN = 64 << 10

# Serialization layouts read here, and their expression types (xgrammar's GrammarExprType).
_KNOWN_VERSIONS = ("v18",)
(_BYTE_STRING, _CHAR_CLASS, _CHAR_CLASS_STAR, _EMPTY, _RULE_REF, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT,
 _TOKEN, _EXCLUDE_TOKEN, _TOKEN_TAG_DISPATCH, _REGEX, _SUBSTRING) = range(14)
# Atoms counted as deriving nothing: a dispatch reads free text until a trigger (and may end there), the token
# kinds match a token of unknown spelling, a substring may be empty. Counting less than an atom's shortest text
# never refuses a grammar that has a finite output, and the rules they lead to are bounded with the others.
_COUNTED_EMPTY = (_CHAR_CLASS_STAR, _EMPTY, _TAG_DISPATCH, _TOKEN, _EXCLUDE_TOKEN, _TOKEN_TAG_DISPATCH, _REGEX,
                  _SUBSTRING)


@dataclass(frozen=True)
class GrammarLengths:
    shortest_output: float  # bytes of the root's shortest derivation; math.inf: no finite output
    longest_sequence_floor: float  # max over the grammar's sequences (and regex parts) of their shortest text

    @property
    def has_finite_output(self) -> bool:
        return self.shortest_output < math.inf

    @property
    def jump_forward_is_bounded(self) -> bool:
        return self.longest_sequence_floor <= MAX_FORCED_TEXT_SPAN


class _UnknownLayout(Exception):
    pass


def grammar_lengths(grammar: xgr.Grammar) -> GrammarLengths | None:
    """The grammar's length bounds, or None if this xgrammar's serialization is not one read here."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") not in _KNOWN_VERSIONS:
        return None
    try:
        return _lengths(data)
    except (_UnknownLayout, KeyError, IndexError, TypeError):
        return None


def token_budget_rules(grammar: xgr.Grammar) -> list[str]:
    """The rules of ``grammar`` with a token budget (EBNF's ``name[max_tokens=N]``), read from its serialization (a
    rule is [name, body, ..., max_tokens, max_chars, ...] in the layouts read here; -1: none); in another layout,
    searched for in the grammar's printed form."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") in _KNOWN_VERSIONS:
        return [rule[0] for rule in data["rules"] if rule[4] != -1]
    return re.findall(r"^(\S+)\[[^\]]*max_tokens=", str(grammar), flags=re.MULTILINE)


def _lengths(data: dict) -> GrammarLengths:
    flat, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]
    bodies = [rule[1] for rule in data["rules"]]
    exprs = [(flat[s], flat[s + 2:s + 2 + flat[s + 1]]) for s in starts]  # (type, operands)
    for kind, _ in exprs:
        if not _BYTE_STRING <= kind <= _SUBSTRING:
            raise _UnknownLayout(kind)

    rule_floor = [math.inf] * len(bodies)

    def floor_of(expr_id: int, memo: dict[int, float]) -> float:
        if expr_id in memo:
            return memo[expr_id]
        kind, ops = exprs[expr_id]
        if kind == _BYTE_STRING:
            value = float(len(ops))
        elif kind == _CHAR_CLASS:
            value = 1.0
        elif kind in _COUNTED_EMPTY:
            value = 0.0
        elif kind == _RULE_REF:
            value = rule_floor[ops[0]]
        elif kind == _SEQUENCE:
            value = sum(floor_of(child, memo) for child in ops)
        elif kind == _CHOICES:
            value = min((floor_of(child, memo) for child in ops), default=math.inf)
        else:  # _REPEAT: [rule_id, min_count, max_count]
            value = 0.0 if ops[1] <= 0 else ops[1] * rule_floor[ops[0]]
        memo[expr_id] = value
        return value

    # Rules in dependency order (each group of mutually recursive rules after the rules it uses), then a
    # fixed point inside each group: every pass settles the rules whose shortest derivation tree is one level
    # taller, and no rule repeats along a path of a shortest tree, so len(group) + 1 passes suffice.
    for group in _rule_groups([_referenced_rules(body, exprs) for body in bodies]):
        for _ in range(len(group) + 1):
            memo: dict[int, float] = {}
            floors = [floor_of(bodies[rule], memo) for rule in group]
            if all(rule_floor[rule] == floor for rule, floor in zip(group, floors)):
                break
            for rule, floor in zip(group, floors):
                rule_floor[rule] = floor
    memo = {}
    spans = [floor_of(i, memo) for i, (kind, _) in enumerate(exprs) if kind == _SEQUENCE]
    # A regex (a JSON string's "pattern") is one atom here, but its own parts force text too.
    spans += [_regex_span(bytes(ops[1:])) for kind, ops in exprs if kind == _REGEX]
    return GrammarLengths(shortest_output=rule_floor[data["root_rule_id"]], longest_sequence_floor=max(spans, default=0.0))


def _referenced_rules(body: int, exprs: list) -> set[int]:
    """Rules whose shortest text the body's shortest text depends on."""
    rules, todo, seen = set(), [body], set()
    while todo:
        expr_id = todo.pop()
        if expr_id in seen:
            continue
        seen.add(expr_id)
        kind, ops = exprs[expr_id]
        if kind in (_RULE_REF, _REPEAT):
            rules.add(ops[0])
        elif kind in (_SEQUENCE, _CHOICES):
            todo.extend(ops)
    return rules


def _rule_groups(uses: list[set[int]]) -> list[list[int]]:
    """The rules' strongly connected components (Tarjan's, without recursion: a chain of thousands of rules is
    common), each after every component it uses."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    groups: list[list[int]] = []
    for start in range(len(uses)):
        if start in index:
            continue
        work = [(start, iter(uses[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            rule, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(uses[child])))
                elif child in on_stack:
                    low[rule] = min(low[rule], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[rule])
            if low[rule] == index[rule]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == rule:
                        break
                groups.append(group)
    return groups


def _regex_span(pattern: bytes) -> float:
    """The longest shortest-match of any part of a regex (Python's parser, whose syntax JSON schema patterns
    share); math.inf where it cannot be parsed."""
    try:
        from re import _parser as sre_parse  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse
    longest = 0.0
    try:
        todo = [sre_parse.parse(pattern.decode("utf-8"))]
        while todo:
            item = todo.pop()
            if isinstance(item, sre_parse.SubPattern):
                longest = max(longest, float(item.getwidth()[0]))
                todo.extend(av for _, av in item)
            elif isinstance(item, (tuple, list)):
                todo.extend(item)
    except Exception:  # any failure to read it means no bound
        return math.inf
    return longest


# Compiled grammars whose jump-forward search was found bounded, marked where they were compiled (the
# compiled grammar's own serialization holds its automata, up to gigabytes: the source grammar is read).
# Keyed by id with a weak reference (xgrammar's compiled grammars are not hashable), dropped when collected.
_bounded_search: dict[int, weakref.ref] = {}


def mark_jump_forward_safe(compiled: xgr.CompiledGrammar, lengths: GrammarLengths | None) -> None:
    """Record what `grammar_lengths` found for the grammar `compiled` was compiled from."""
    if lengths is not None and lengths.jump_forward_is_bounded:
        key = id(compiled)
        _bounded_search[key] = weakref.ref(compiled, lambda ref: _forget(key, ref))


def _forget(key: int, ref: weakref.ref) -> None:
    if _bounded_search.get(key) is ref:
        del _bounded_search[key]


def jump_forward_is_safe(compiled: xgr.CompiledGrammar) -> bool:
    """Whether `find_jump_forward_string` was shown to end soon from every state of this grammar (False for a
    grammar that was not checked)."""
    ref = _bounded_search.get(id(compiled))
    return ref is not None and ref() is compiled
