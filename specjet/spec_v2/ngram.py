"""N-gram drafting: no model, no training.

Drafts come from matching the last tokens of a request (its prompt and output so far) against
earlier places in the same sequence: what followed those earlier occurrences is proposed as the
continuation. Several matches branch into a tree (a trie of continuations), so the verifier can
accept whichever one the target agrees with. Good on JSON (keys and punctuation repeat) and on
tasks that copy from the prompt.

``NgramIndex`` is the per-request suffix index: for every n-gram length 1..max_window it maps the
n-gram to the positions where it ends, updated incrementally as tokens are accepted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class NgramConfig:
    num_draft_tokens: int = 8  # tree nodes including the root
    max_window: int = 4  # longest suffix matched
    min_window: int = 1  # shortest suffix matched (1 matches any earlier occurrence of the last token)
    max_branches: int = 4  # distinct continuations tried per draft
    max_matches_scanned: int = 32  # most recent occurrences looked at per window


class NgramIndex:
    def __init__(self, max_window: int):
        self.max_window = max_window
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            t = len(self.tokens) - 1
            for w in range(1, min(self.max_window, t + 1) + 1):
                key = tuple(self.tokens[t - w + 1: t + 1])
                self._ends.setdefault(key, []).append(t)

    def continuations(self, cfg: NgramConfig, max_len: int, after: list[int] = ()) -> list[list[int]]:
        """Up to ``cfg.max_branches`` distinct continuations of the current suffix, best first:
        longer matched windows first, then more recent occurrences. ``after``: tokens taken as
        already following the sequence (a grammar's forced chain): the suffix matched ends with
        them, and continuations are of the extended sequence."""
        after = list(after)
        n = len(self.tokens)
        seq_len = n + len(after)
        tail = self.tokens[-cfg.max_window:] + after
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for w in range(min(cfg.max_window, seq_len - 1), cfg.min_window - 1, -1):
            ends = self._ends.get(tuple(tail[len(tail) - w:]), ())
            scanned = 0
            for end in reversed(ends):
                if end >= seq_len - 1:  # the suffix itself
                    continue
                scanned += 1
                if scanned > cfg.max_matches_scanned:
                    break
                cont = self.tokens[end + 1: end + 1 + max_len]
                key = tuple(cont)
                if cont and key not in seen:
                    seen.add(key)
                    found.append(cont)
                    if len(found) >= cfg.max_branches:
                        return found
        return found


def build_trie(root_token: int, continuations: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Merge continuations into a tree with at most ``max_nodes`` nodes (root included).

    Returns (tokens, parents) with the root at index 0 (parent -1), every parent before its
    children, and children in the order their continuations were given (best first)."""
    tokens, parents = [root_token], [-1]
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cont in continuations:
        node = 0
        for tok in cont:
            nxt = children.get((node, tok))
            if nxt is None:
                if len(tokens) >= max_nodes:
                    break
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(node)
                children[(node, tok)] = nxt
            node = nxt
    return tokens, parents  # creation order: parents before children, siblings best first


def merge_trees(first: tuple[list[int], list[int]], second: tuple[list[int], list[int]], max_nodes: int
                ) -> tuple[list[int], list[int]]:
    """The union of two draft trees under the same root, as one tree of at most ``max_nodes``
    nodes: ``first``'s nodes in its order, then ``second``'s that it lacks (a node whose path
    ``first`` already has is that node, so its subtree hangs there). Both trees list parents before
    children, and so does the result: any prefix of it is a tree."""
    tokens, parents = first[0][:max_nodes], first[1][:max_nodes]
    if second[0][0] != tokens[0]:
        raise ValueError(f"trees with different roots ({tokens[0]} vs {second[0][0]}) cannot be merged")
    tokens, parents = list(tokens), list(parents)
    node_of = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents)) if i}
    mapped = {0: 0}  # second's node -> the result's
    for j in range(1, len(second[0])):
        parent = mapped.get(second[1][j])
        if parent is None:  # its parent did not fit
            continue
        key = (parent, second[0][j])
        node = node_of.get(key)
        if node is None:
            if len(tokens) >= max_nodes:
                continue
            node = node_of[key] = len(tokens)
            tokens.append(second[0][j])
            parents.append(parent)
        mapped[j] = node
    return tokens, parents


class PathLength:
    """How many tokens each request's hybrid n-gram path may have: half of ``max_len`` as a rule, up to
    all of it while its paths keep being taken whole.

    The path costs verify nodes whether or not the target takes it. On repetitive text (a JSON array
    of records, repeated keys and values) it is right a dozen tokens at a time; on prose it is right
    now and then, for a few tokens, and a longer guess there only makes the verify dearer. So a
    request's limit doubles (up to ``max_len``) each time its path is taken whole at the limit, and
    after a miss drops to one past what was taken, but by half at most and never below the rule.
    Measured (bench/RESULTS.md, session 5): the adaptive limit gives held-out JSON the accept of a
    fixed ``max_len`` path and GSM8K the speed of a fixed half-length one."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.min_len = max(1, max_len // 2)
        self._limits: dict[str, int] = {}

    def limit(self, rid: str) -> int:
        return self._limits.get(rid, self.min_len)

    def update(self, rid: str, proposed: int, taken: int) -> None:
        """After a verify: the path had ``proposed`` tokens (beyond any forced chain) and the target
        took the first ``taken``. No path, nothing learned."""
        if proposed <= 0:
            return
        limit = self.limit(rid)
        if taken >= proposed:
            if proposed >= limit:  # taken whole at the limit: try longer (a match that ran out says nothing)
                self._limits[rid] = min(self.max_len, 2 * limit)
        else:
            self._limits[rid] = max(self.min_len, taken + 1, limit // 2)

    def release(self, rid: str) -> None:
        self._limits.pop(rid, None)


def first_path(tokens: list[int], parents: list[int]) -> list[int]:
    """The tokens of a tree's first root-to-leaf path, root left out: node 1, its first child, ... (in a
    trie from ``build_trie`` that is its first branch)."""
    path, node = [], 0
    for i in range(1, len(tokens)):
        if parents[i] == node:
            path.append(tokens[i])
            node = i
    return path


class NgramDrafter:
    """Proposes a draft tree per request from its own n-gram index."""

    def __init__(self, cfg: NgramConfig):
        self.cfg = cfg
        self._indexes: dict[str, NgramIndex] = {}

    def observe(self, rid: str, all_tokens: list[int]) -> None:
        """Bring the request's index up to date with its full token list (prompt + output)."""
        index = self._indexes.get(rid)
        if index is None or len(index.tokens) > len(all_tokens):
            index = self._indexes[rid] = NgramIndex(self.cfg.max_window)
        index.extend(all_tokens[len(index.tokens):])

    def propose(self, rid: str, max_nodes: int, chain: list[int] = (),
                legal_len: Callable[[list[int], list[int]], int] | None = None) -> tuple[list[int], list[int]]:
        """A trie of continuations under the last token. Grammar-aware drafting passes ``chain``
        (the grammar's forced tokens: a sure branch, and the place continuations are matched from)
        and ``legal_len`` (``legal_len(prefix, tokens)``: how many of ``tokens`` the grammar
        accepts after ``prefix``): each continuation is cut at its first illegal token, so the
        node budget goes to tokens verification can accept.

        The forced *text* is certain but the chain is only the tokenizer's split of it, and a
        constrained model often spells differently ('a', 'rg', 'um', 'en', 't', 's' where the
        tokenizer says 'a', 'rguments'). So a legal continuation matched from the sequence itself
        that leaves the chain within the chain's length goes first: once the request has written
        that text before, its own spelling is the better guess. The chain's branch follows."""
        index = self._indexes[rid]
        max_nodes = min(max_nodes, self.cfg.num_draft_tokens)
        chain = list(chain)[: max(0, max_nodes - 1)]
        respelled = []
        if chain:
            respelled = index.continuations(self.cfg, max_len=max_nodes - 1)
            if legal_len is not None:
                respelled = [cont[: legal_len([], cont)] for cont in respelled]
            respelled = [cont for cont in respelled if cont and cont[: len(chain)] != chain[: len(cont)]]
        room = max_nodes - 1 - len(chain)
        conts = index.continuations(self.cfg, max_len=room, after=chain) if room > 0 else []
        if legal_len is not None:
            conts = [cont[: legal_len(chain, cont)] for cont in conts]
        branches = respelled + [chain + cont for cont in conts]
        return build_trie(index.tokens[-1], branches[: self.cfg.max_branches] + [chain], max_nodes)

    def release(self, rid: str) -> None:
        self._indexes.pop(rid, None)
