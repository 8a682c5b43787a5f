"""The prefix cache: a radix tree over token ids whose nodes own the KV pages of those tokens.

A request matches the longest cached prefix of its tokens at admission, locks the node where the
match ends (a lock holds the node and every ancestor), points its first positions at the cached
slots and prefills only the rest. Its prompt is inserted after its prefill and its whole committed
sequence when it ends; unlocked leaves are evicted least recently used when the pool needs room.

With ``page_size > 1`` everything is page-aligned: keys are compared a page of tokens at a time, a
node's key length is a multiple of the page size, and a node owns whole pages (a request's
partial last page is never cached). Children are keyed by their first page of tokens.

The tree never writes KV and never touches a request's row of the request-to-token table: it
takes over slots a request computed, hands their pages back to the allocator when it evicts them,
and reports what it holds for the KV invariant. It lives on the scheduler thread.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from specjet.scheduler.memory_pool import TokenToKVPoolAllocator


@dataclass(eq=False)
class TreeNode:
    key: list[int]  # the tokens this edge adds (a multiple of page_size; empty for the root)
    slots: torch.Tensor  # their KV slots, one per token
    parent: TreeNode | None = None
    children: dict = field(default_factory=dict)  # first page of tokens (tuple) -> child
    lock_ref: int = 0  # requests holding this node or a descendant
    last_access: int = 0
    # The token that followed this node's last position in the request whose KV it holds (None:
    # unknown). Per-position draft state that reads the next token (EAGLE's draft KV) at that last
    # position is valid for a request only if its own next token is this one.
    next_token: int | None = None

    @property
    def depth(self) -> int:
        """Tokens from the root to the end of this node."""
        n, node = 0, self
        while node is not None:
            n += len(node.key)
            node = node.parent
        return n


@dataclass
class MatchResult:
    length: int  # tokens matched (a multiple of page_size)
    slots: torch.Tensor  # their KV slots
    node: TreeNode  # where the match ends (the root when nothing matched)
    # Positions of the match whose next-token-dependent draft state fits these tokens: every
    # node on the path holds the draft state its own request made, and at the last position of
    # a node that request's next token may not be this one's (TreeNode.next_token).
    next_token_len: int = 0


class RadixCache:
    def __init__(self, allocator: TokenToKVPoolAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64), lock_ref=1)  # never evicted
        self._clock = itertools.count(1)
        self.cached_tokens = 0  # tokens held by the tree
        self.evictable_tokens = 0  # of them, in nodes no request holds
        self.stats = {"prompt_tokens": 0, "hit_tokens": 0, "evicted_tokens": 0, "inserted_tokens": 0}

    # ---------------------------------------------------------------- lookup
    def match_prefix(self, tokens: list[int]) -> MatchResult:
        """The longest cached page-aligned prefix of ``tokens``. A match that ends inside a node
        splits it, so the result always ends at a node boundary (the node a request locks)."""
        p = self.page_size
        node, matched, parts, path = self.root, 0, [], []
        now = next(self._clock)
        node.last_access = now
        while len(tokens) - matched >= p:
            child = node.children.get(tuple(tokens[matched:matched + p]))
            if child is None:
                break
            n = self._common_len(child.key, tokens, matched)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.slots)
            matched += n
            node = child
            path.append((matched, node))
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        next_token_len = matched
        for depth, on_path in path:
            if depth >= len(tokens) or on_path.next_token != tokens[depth]:
                next_token_len = depth - 1
                break
        return MatchResult(matched, slots, node, next_token_len)

    def _common_len(self, key: list[int], tokens: list[int], start: int) -> int:
        """Tokens of ``key`` that ``tokens[start:]`` agrees with, whole pages only."""
        p = self.page_size
        n = 0
        limit = min(len(key), len(tokens) - start)
        while n + p <= limit and key[n:n + p] == tokens[start + n:start + n + p]:
            n += p
        return n

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after its first ``n`` tokens; returns the new upper node."""
        p = self.page_size
        upper = TreeNode(child.key[:n], child.slots[:n], parent=child.parent, lock_ref=child.lock_ref,
                         last_access=child.last_access, next_token=child.key[n])
        upper.parent.children[tuple(child.key[:p])] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        upper.children[tuple(child.key[:p])] = child
        return upper

    # ---------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        """A request holds ``node`` (and so its ancestors): none of them can be evicted."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref < 0:
                raise AssertionError("radix cache: a node was unlocked more often than locked")
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.key)
            node = node.parent

    # ---------------------------------------------------------------- insertion
    def insert(self, tokens: list[int], slots: torch.Tensor, next_token: int | None = None) -> tuple[int, TreeNode]:
        """Cache ``tokens`` (page-aligned length) with their KV ``slots``; ``next_token``: the token
        that follows them in the request (see ``TreeNode.next_token``). Returns how many leading
        tokens the tree already held (the caller still owns those slots of its own, duplicates it
        must free) and the node that now ends ``tokens``; the slots from there on belong to the tree."""
        p = self.page_size
        if len(tokens) % p or len(tokens) != len(slots):
            raise ValueError("radix cache: insert needs a page-aligned key and one slot per token")
        match = self.match_prefix(tokens)
        existing, node = match.length, match.node
        if existing < len(tokens):
            leaf = TreeNode(list(tokens[existing:]), slots[existing:].clone(), parent=node,
                            last_access=next(self._clock), next_token=next_token)
            node.children[tuple(leaf.key[:p])] = leaf
            added = len(leaf.key)
            self.cached_tokens += added
            self.evictable_tokens += added
            self.stats["inserted_tokens"] += added
            node = leaf
        return existing, node

    # ---------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (fewer when not enough are evictable) from unlocked
        leaves, least recently used first; returns the slots freed."""
        if num_tokens <= 0 or self.evictable_tokens == 0:
            return 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            freed += self._drop(leaf)
            parent = leaf.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> int:
        """Evict every node no request holds; returns the slots freed."""
        return self.evict(self.cached_tokens)

    def _drop(self, leaf: TreeNode) -> int:
        del leaf.parent.children[tuple(leaf.key[:self.page_size])]
        n = len(leaf.key)
        self.allocator.free_slots(leaf.slots)
        self.cached_tokens -= n
        self.evictable_tokens -= n
        self.stats["evicted_tokens"] += n
        return n

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                yield node

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    # ---------------------------------------------------------------- reporting and checks
    def info(self) -> dict:
        s = self.stats
        return {"cached_tokens": self.cached_tokens, "evictable_tokens": self.evictable_tokens,
                "hit_tokens": s["hit_tokens"], "prompt_tokens": s["prompt_tokens"],
                "hit_rate": s["hit_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0,
                "inserted_tokens": s["inserted_tokens"], "evicted_tokens": s["evicted_tokens"]}

    def owned_slots(self) -> dict[object, torch.Tensor]:
        """Each node's slots, keyed by an owner name for the KV invariant."""
        return {f"radix node {i}": node.slots for i, node in enumerate(self._nodes())}

    def check(self, held_nodes: list[TreeNode]) -> None:
        """The tree's own consistency: key and slot lengths agree and are page-aligned, children
        are keyed by their first page, every node's lock count equals the requests holding it or
        a descendant (``held_nodes``: the node each live request holds), and the token counters
        agree with the nodes. Raises AssertionError naming the problem."""
        p = self.page_size
        expected: dict[int, int] = {}
        for node in held_nodes:
            while node is not None and node is not self.root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        total = evictable = 0
        for node in self._nodes():
            if len(node.key) != len(node.slots) or not node.key or len(node.key) % p:
                raise AssertionError(f"radix node of {len(node.key)} tokens has {len(node.slots)} slots (page {p})")
            if node.parent.children.get(tuple(node.key[:p])) is not node:
                raise AssertionError("radix node is not its parent's child under its first page")
            if node.lock_ref != expected.get(id(node), 0):
                raise AssertionError(f"radix node lock count {node.lock_ref} != {expected.get(id(node), 0)} "
                                     "requests holding it")
            total += len(node.key)
            evictable += len(node.key) if node.lock_ref == 0 else 0
        if (total, evictable) != (self.cached_tokens, self.evictable_tokens):
            raise AssertionError(f"radix cache counts {self.cached_tokens}/{self.evictable_tokens} cached/evictable "
                                 f"tokens, its nodes hold {total}/{evictable}")
