"""The speculative configuration: every drafter's parameters and every default, in one place.

The engine's arguments use SGLang's names (``speculative_num_draft_tokens`` and so on) and leave
the algorithm-dependent ones None; ``SpecConfig.from_args`` fills the defaults below and checks
the values, so the rest of ``spec_v2`` reads one frozen object whose names say what they count:
``max_tree_nodes`` is the size of one request's verify tree, ``EagleParams.tree_nodes`` the size
of the learned part of it, ``hybrid_path_nodes`` the n-gram path merged into it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

ALGORITHMS = ("EAGLE", "NGRAM", "DFLASH")
HYBRID_ALGORITHMS = ("EAGLE", "DFLASH")  # learned drafters whose trees may take the request's n-gram path
DRAFT_RUNNERS = ("auto", "eager", "static")  # speculative_draft_runner


@dataclass(frozen=True)
class EagleParams:
    num_steps: int = 4  # draft forwards per iteration (tree depth, forced chains aside)
    topk: int = 4  # children per expanded node, and nodes expanded per step
    tree_nodes: int = 12  # nodes of the reranked learned tree, root included


@dataclass(frozen=True)
class NgramConfig:
    max_window: int = 4  # longest suffix matched
    min_window: int = 1  # shortest suffix matched (1 matches any earlier occurrence of the last token)
    max_branches: int = 4  # distinct continuations tried per draft
    max_matches_scanned: int = 32  # most recent occurrences looked at per window


@dataclass(frozen=True)
class DFlashParams:
    # Tokens of a block, root included (speculative_num_draft_tokens): the draft forward's rows, and the
    # verify's nodes (a tree of topk > 1 takes as many; with the n-gram path, block + path in all).
    # 8: the block the shipped draft was trained with; past it the draft's positions are untrained,
    # and a CPU verify of 16 nodes costs far more than one of 8 (bench/RESULTS.md, session 13).
    block_size: int = 8
    # Context positions the draft sees before its block (speculative_dflash_draft_window_size):
    # the last W; None: all of them.
    window: int | None = None
    # Candidates per block position (speculative_eagle_topk, SGLang's name for the draft's width):
    # 1 verifies the block as a chain (DFlash as published); k > 1 a lattice tree, any node continued
    # by the next position's k best tokens, the most likely paths first down to the confidence cut
    # (spec_v2/dflash_drafter.py). 3: with the 1-layer draft it matched or beat 2 and the chain on
    # GSM8K and stayed within noise of them on JSON schemas (bench/RESULTS.md, session 18).
    topk: int = 3
    # The same for a request under a grammar, unless speculative_eagle_topk is given (then it is both):
    # the grammar already narrows each position and forces text, and the chain beat the 3-wide tree on
    # JSON schemas in four of four bf16 comparisons, at batch 1 and 4 (bench/RESULTS.md, sessions 20-21).
    grammar_topk: int = 1
    # Under a grammar, past the block's end: the text the grammar still forces after the chain, as sure
    # tokens (verify rows, no draft work). On where a verify row is cheap beside the token it may add
    # (float weights: bf16 accept 4.86 -> 5.10 on JSON schemas at equal tokens/s); off for quantized
    # CPU targets, where the extra rows cost more than they gained (5% slower; bench/RESULTS.md, session 23).
    forced_tail: bool = True


# EAGLE's defaults for a target with quantized weights on the CPU (the GGUF blocks, int8, int4): there
# a one-token step streams ~4x fewer bytes while every verify row costs integer dot products, so a
# verify row is dear against the step it replaces. One learned draft token (a chain of 2 nodes with the
# root) and a longer n-gram path beat the float default tree on JSON schemas and on free text, on
# AVX-512 VNNI and on AVX2 (bench/RESULTS.md, session 15).
QUANTIZED_EAGLE = EagleParams(num_steps=1, topk=1, tree_nodes=2)
QUANTIZED_HYBRID_PATH_NODES = 10  # EAGLE's and DFLASH's
# DFLASH likewise: a chain of the root and 2 block positions, and the n-gram path (the float default,
# a tree of 8 nodes, cost more than it saved on a quantized target: RESULTS, session 15).
QUANTIZED_DFLASH = DFlashParams(block_size=3, topk=1, forced_tail=False)

# The confidence cut of learned drafts (speculative_draft_min_prob) when not given: a node whose path
# probability under the draft is below this is not verified. Every verify row costs a fraction of a
# decode step on the CPU, so a node the target will most likely reject costs more than it can save.
# 0.1 beat 0 (the whole tree), 0.05 and 0.2 for DFLASH's block and 0, 0.02, 0.05, 0.2 and 0.3 for
# EAGLE's tree with float weights; with quantized weights, whose default drafts are short, it changed
# nothing measurable (bench/RESULTS.md, session 16).
DFLASH_MIN_DRAFT_PROB = 0.1
EAGLE_MIN_DRAFT_PROB = 0.1
# With those defaults on a float CPU target, the cut of a request without a grammar grows with the batch:
# the default times batch / 2, at most this. A node pays for its verify row when its chance of being
# accepted exceeds the row's cost times the tokens per millisecond the engine already makes, and that
# grows with the batch (the sweeps on GSM8K at batch 2, 4 and 8: bench/RESULTS.md, session 24). Under a
# grammar the cut stays: a chain node there also carries the grammar's forced text after it, which a
# higher cut throws away with it (slower on JSON schemas at batch 4).
BATCH_MIN_DRAFT_PROB_CAP = 0.4
# DFLASH's tree for a request without a grammar that decodes alone, on a CPU target whose bf16 projections run on
# AMX tiles (kernels/bf16_gemm.py): a verify's rows there cost little until they fill a 16-row tile (a bf16 verify
# of 16 nodes ~1.3x a one-token step, of 18 ~1.8x: bench/RESULTS.md, session 96), so a wider tree with a lower cut
# (4 candidates a position, 0.06; the usual 3 and 0.1 elsewhere) decodes GSM8K chat at the same speed (1.10x, 0.97x,
# 1.01x in three runs) with acceptance 3.68 instead of 3.50. Given arguments win; batches and grammars keep theirs.
TILED_BF16_ALONE_TOPK = 4
TILED_BF16_ALONE_MIN_DRAFT_PROB = 0.06
# The same for a request under a grammar decoding alone there: 4 candidates a position (among the tokens the grammar
# allows) and a cut of 0.02, in place of the chain. With its learned nodes kept within one tile (below) it accepts
# what EAGLE-GA does on JSON schemas the draft never saw, where the chain accepts ~8% less (bench/RESULTS.md,
# session 97); uncapped, a third of its verifies started a second tile and it decoded slower than the chain.
TILED_BF16_ALONE_GRAMMAR_TOPK = 4
TILED_BF16_ALONE_GRAMMAR_MIN_DRAFT_PROB = 0.02
# Rows of one AMX tile (kernels/bf16_gemm.py): on such a target a lone request's learned drafts fill its verify up
# to this many nodes and no further (its n-gram path and the grammar's forced text, which are longer and far more
# often right, may pass it). A 17th row starts a second tile, ~0.4x of a one-token step (session 96), and the
# nodes past 16 of a 4-wide tree are its least likely ones.
TILED_ROWS = 16
# On a CPU target with quantized weights, a request without a grammar drafts only in a batch of at most
# this many (beside others its tree is its root alone: a plain decoding step through the verify). There a
# one-token step streams 4-bit weights and a batch of 2 costs little more than one, so every verify row is
# dear: on GSM8K EAGLE and DFLASH were 1.13-1.16x plain at batch 1 but 0.68-0.81x at batch 2 and 0.65-0.75x
# at batch 4 (bench/RESULTS.md, session 24), NGRAM 0.76x and 0.54x (session 60). Constrained requests keep
# drafting (forced text is sure), and so do requests with a prediction.
QUANTIZED_FREE_TEXT_DRAFT_BATCH = 1
# Verify nodes of one forward, all requests together (speculative_max_verify_tokens; each tree gets an
# even share), when not given and EAGLE or DFLASH runs on a CPU target with float weights: a verify row
# costs a fraction of a decode step there, so at batch 4 the full trees made speculation 0.79-0.82x plain
# on GSM8K (bf16); 32 made it 0.93-0.97x and left JSON schemas at or above the full trees (2.69 -> 2.82x,
# 3.09 -> 3.10x), and changes nothing at batch 1, whose trees are smaller (bench/RESULTS.md, session 21).
FLOAT_CPU_MAX_VERIFY_NODES = 32
DRAFT_QUANTIZATION_NEEDS_LEARNED_DRAFT = (
    "speculative_draft_model_quantization sets a learned draft's weights: it needs speculative_algorithm='EAGLE' or "
    "'DFLASH', or the default engine's free-text drafting (on a CPU, for the default model or with "
    "speculative_draft_model_path, with disable_guided_drafting and disable_free_text_drafting False and "
    "enable_deterministic_inference True)")
MIN_PROB_NEEDS_LEARNED_DRAFT = ("speculative_draft_min_prob cuts a learned draft's unlikely nodes: it needs "
                                "speculative_algorithm='EAGLE' or 'DFLASH'")

# NGRAM: nodes of a request's verify tree when speculative_num_draft_tokens is not given.
NGRAM_TREE_NODES = 8
# EAGLE and DFLASH: the longest n-gram path merged into each learned tree when speculative_hybrid_ngram_tokens
# is not given (float weights): long enough for a repeated record of a JSON array, and cheap where it is not taken
# because the path's length adapts (bench/RESULTS.md has the sweep that chose it).
HYBRID_PATH_NODES = 14


@dataclass(frozen=True)
class LoneTree:
    """DFLASH's tree for a request decoding alone in its batch, where it is not the drafter's own (None: the drafter's
    width and ``min_draft_prob``, every node of its share): candidates per block position and confidence cut without
    a grammar and under one, and the verify nodes its learned drafts may fill, root included (its n-gram path and
    the grammar's forced chain may go further). ``TILED_BF16_ALONE_*`` and ``TILED_ROWS`` by default where verify
    rows come in 16-row tiles (``SpecConfig.from_args``)."""

    topk: int | None = None
    min_draft_prob: float | None = None
    grammar_topk: int | None = None
    grammar_min_draft_prob: float | None = None
    learned_nodes: int | None = None

    def __post_init__(self) -> None:
        for cut in (self.min_draft_prob, self.grammar_min_draft_prob):
            if cut is not None and not 0.0 <= cut <= 1.0:  # also false for NaN
                raise ValueError(f"a lone request's draft cut must be in [0, 1], got {cut}")
        for width in (self.topk, self.grammar_topk):
            if width is not None and width < 1:
                raise ValueError(f"a lone request's candidates per block position must be >= 1, got {width}")
        if self.learned_nodes is not None and self.learned_nodes < 2:
            raise ValueError(f"a lone request's learned nodes must be >= 2 (the root and one draft), "
                             f"got {self.learned_nodes}")

    def is_set(self) -> bool:
        return any(v is not None for v in (self.topk, self.min_draft_prob, self.grammar_topk,
                                           self.grammar_min_draft_prob, self.learned_nodes))


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str  # one of ALGORITHMS
    # Nodes of one request's verify tree, root included: the drafter's tree (EAGLE: its learned tree
    # plus the hybrid n-gram path). The scheduler reserves this many positions per iteration.
    max_tree_nodes: int = NGRAM_TREE_NODES
    eagle: EagleParams = EagleParams()
    ngram: NgramConfig = NgramConfig()
    dflash: DFlashParams = DFlashParams()
    # EAGLE head / DFlash draft directory; None: the one shipped with specjet for the default model.
    draft_model_path: str | None = None
    # The draft's weights (speculative_draft_model_quantization, resolved by engine/loading.py with
    # models/quantize.py choose_draft_method): a method name, None (float), or "target" (as the target).
    draft_quantization: str | None = "target"
    # Grammar-aware drafting: draft top-k over grammar-legal tokens only, and the grammar's forced
    # continuation enters the tree as free nodes (specjet's own knob).
    grammar_aware: bool = True
    # EAGLE and DFLASH: each tree also takes the request's best n-gram continuation, a path of at most
    # this many nodes under the root (its length adapts per request: spec_v2/hybrid.py PathLength).
    hybrid_path_nodes: int = 0
    # EAGLE and DFLASH: tree nodes whose path probability under the draft (the product of the draft's
    # probabilities along the path) is below this are left out of the verify (0: none left out).
    min_draft_prob: float = 0.0
    # Whether that cut grows with the batch for requests without a grammar (``min_draft_logp``): the
    # default on a float CPU target, where every verify row costs a fraction of a decode step.
    min_draft_prob_grows: bool = False
    # DFLASH, a request alone in its batch: its own tree (width, cut, learned nodes) where set.
    alone: LoneTree = LoneTree()
    # A request without a grammar or a prediction gets a tree beyond its root only in a batch of at most this
    # many requests (None: any batch): ``QUANTIZED_FREE_TEXT_DRAFT_BATCH`` on a quantized CPU target; 0 (never)
    # with ``guided_only``.
    free_text_draft_batch: int | None = None
    # A request without a grammar decoding alone drafts only while it measures that drafting pays
    # (spec_v2/payoff.py; speculative_measured_payoff: by default on a CPU target).
    measured_payoff: bool = False
    # Tree nodes one verify forward may hold across its batch (None: no cap): each tree gets an even
    # share. A CPU verify costs about its token count once the batch is past a few rows.
    max_verify_nodes: int | None = None
    # How the drafter's fixed-shape forwards run (speculative_draft_runner): "eager", or "static":
    # padded batch buckets on static buffers (models/graph_runner.py), captured as CUDA graphs
    # on CUDA unless ``cuda_graph`` is off. "auto" resolves per device in ``runner_mode``.
    draft_runner: str = "auto"
    cuda_graph: bool = True
    # Only guided requests draft (NGRAM trees): those that bring a prediction or decode under a grammar, whose
    # drafts cost no model forward and are often right; a decode batch without one is a plain step. What an
    # engine without ``speculative_algorithm`` runs (``for_guided``).
    guided_only: bool = False
    # With ``guided_only``: the configuration of a DFLASH speculator that drafts for a request without a grammar or a
    # prediction while it decodes alone, from its prefill on (``for_guided(..., free_text=True)``); None: such a
    # request never drafts. A request that decodes beside others once takes plain steps to its end.
    solo: "SpecConfig | None" = None
    # Not part of the configuration's identity: a loaded head handed in directly (tests, tools).
    eagle_head: object = field(default=None, compare=False, repr=False)
    dflash_draft: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            # SGLang's EAGLE3 is specjet's EAGLE: an EAGLE-3 head says what it is itself (its feature_layers).
            eagle3 = " (an EAGLE-3 head runs as 'EAGLE')" if str(self.algorithm).upper() == "EAGLE3" else ""
            raise ValueError(f"speculative_algorithm={self.algorithm!r} is not available "
                             f"(available: {', '.join(ALGORITHMS)}){eagle3}")
        e, n = self.eagle, self.ngram
        for name, value in (("max_tree_nodes", self.max_tree_nodes), ("speculative_num_steps", e.num_steps),
                            ("speculative_eagle_topk", e.topk), ("EAGLE tree nodes", e.tree_nodes),
                            ("speculative_ngram_max_bfs_breadth", n.max_branches)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.hybrid_path_nodes < 0:
            raise ValueError(f"speculative_hybrid_ngram_tokens must be >= 0, got {self.hybrid_path_nodes}")
        if self.hybrid_path_nodes and self.algorithm not in HYBRID_ALGORITHMS:
            raise ValueError("speculative_hybrid_ngram_tokens adds n-gram nodes to learned drafts: it needs "
                             "speculative_algorithm='EAGLE' or 'DFLASH'")
        if self.algorithm == "DFLASH" and self.dflash.block_size < 2:
            raise ValueError(f"speculative_num_draft_tokens is DFLASH's block size (the root and its drafts): "
                             f"it must be >= 2, got {self.dflash.block_size}")
        if not 0.0 <= self.min_draft_prob <= 1.0:  # also false for NaN
            raise ValueError(f"speculative_draft_min_prob must be in [0, 1], got {self.min_draft_prob}")
        if self.alone.is_set() and self.algorithm != "DFLASH":
            raise ValueError("a lone request's own draft cut, width and learned nodes are DFLASH's")
        if self.min_draft_prob and self.algorithm not in HYBRID_ALGORITHMS:
            raise ValueError(MIN_PROB_NEEDS_LEARNED_DRAFT)
        if self.dflash.window is not None and self.dflash.window < 1:
            raise ValueError(f"speculative_dflash_draft_window_size must be >= 1, got {self.dflash.window}")
        if self.max_verify_nodes is not None and self.max_verify_nodes < 1:
            raise ValueError(f"speculative_max_verify_tokens must be >= 1, got {self.max_verify_nodes}")
        if not 1 <= n.min_window <= n.max_window:
            raise ValueError("need 1 <= speculative_ngram_min_match_window_size <= speculative_ngram_max_match_window_size")
        _check_draft_runner(self.draft_runner)
        if self.solo is not None and not (self.guided_only and self.solo.algorithm == "DFLASH"):
            raise ValueError("a solo drafter is a DFLASH configuration beside guided drafting")

    def min_draft_logp(self, batch_size: int = 1, constrained: bool = False) -> float:
        """The confidence cut of one request's tree in a batch of ``batch_size`` as the drafters compare
        it, a path log-probability (-inf: no cut): ``min_draft_prob``, or where it grows with the batch
        and the request has no grammar, ``min_draft_prob * batch_size / 2`` within [min_draft_prob,
        BATCH_MIN_DRAFT_PROB_CAP]; for a request alone in its batch, ``alone.min_draft_prob`` (without a grammar)
        or ``alone.grammar_min_draft_prob`` (under one) where that is set."""
        prob = self.min_draft_prob
        alone = self.alone.grammar_min_draft_prob if constrained else self.alone.min_draft_prob
        if batch_size == 1 and alone is not None:
            prob = alone
        elif self.min_draft_prob_grows and not constrained:
            prob = max(prob, min(prob * batch_size / 2, BATCH_MIN_DRAFT_PROB_CAP))
        return math.log(prob) if prob > 0 else -math.inf

    def draft_width(self, batch_size: int = 1, constrained: bool = False) -> int | None:
        """Candidates per block position of one request's DFLASH tree in a batch of ``batch_size``, where that is
        not the drafter's own: for a request alone in its batch ``alone.topk`` (without a grammar) or
        ``alone.grammar_topk`` (under one); else None."""
        if batch_size != 1:
            return None
        return self.alone.grammar_topk if constrained else self.alone.topk

    def learned_nodes(self, batch_size: int = 1) -> int | None:
        """Verify nodes, root included, that one request's learned drafts may fill in a batch of ``batch_size``
        (None: its whole share): ``alone.learned_nodes`` for a request alone in its batch."""
        return self.alone.learned_nodes if batch_size == 1 else None

    def runner_mode(self, device) -> tuple[bool, bool]:
        """(static buffers, CUDA graph capture) for a drafter on ``device``. auto: CUDA graphs on
        CUDA; eager on the CPU, where the padded static path measured no faster (bench/RESULTS.md)."""
        cuda = torch.device(device).type == "cuda"
        static = self.draft_runner == "static" or (self.draft_runner == "auto" and cuda and self.cuda_graph)
        return static, static and cuda and self.cuda_graph

    @classmethod
    def from_args(cls, args, quantized_cpu_target: bool = False, cpu_target: bool = False,
                  tiled_bf16_target: bool = False) -> "SpecConfig | None":
        """The configuration an engine's arguments (``EngineArgs``, SGLang's names) ask for; None
        without ``speculative_algorithm``. ``quantized_cpu_target``: the target computes with
        quantized weights on the CPU (EAGLE's and DFLASH's defaults are then ``QUANTIZED_EAGLE`` and
        ``QUANTIZED_DFLASH``, each with an n-gram path); ``cpu_target``: it runs on the CPU (with float
        weights, EAGLE's and DFLASH's verify forwards then hold ``FLOAT_CPU_MAX_VERIFY_NODES``);
        ``tiled_bf16_target``: its bf16 projections run on AMX tiles (DFLASH's tree for a request alone in its batch
        is then ``TILED_BF16_ALONE_TOPK`` wide and cut at ``TILED_BF16_ALONE_MIN_DRAFT_PROB``, under a grammar
        ``TILED_BF16_ALONE_GRAMMAR_*``, each unless given, and its learned nodes fill at most ``TILED_ROWS`` verify
        nodes unless ``speculative_max_verify_tokens`` is given). Raises
        ValueError naming the argument that is out of range."""
        for name, least in _LEAST.items():
            value = getattr(args, name)
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
            most = _MOST.get(name)
            if value is not None and most is not None and value > most:
                raise ValueError(f"{name} must be <= {most}, got {value}")
        algorithm = args.speculative_algorithm
        _check_draft_runner(args.speculative_draft_runner)  # checked with or without an algorithm
        if args.speculative_hybrid_ngram_tokens and algorithm not in HYBRID_ALGORITHMS:
            raise ValueError("speculative_hybrid_ngram_tokens adds n-gram nodes to learned drafts: it needs "
                             "speculative_algorithm='EAGLE' or 'DFLASH'")
        if args.speculative_draft_min_prob is not None and algorithm not in HYBRID_ALGORITHMS:
            raise ValueError(MIN_PROB_NEEDS_LEARNED_DRAFT)
        # Without an algorithm the default engine may still load a learned draft for free text (EngineArgs
        # checks that one will: drafts_free_text).
        if (args.speculative_draft_model_quantization != "auto" and algorithm is not None
                and algorithm not in HYBRID_ALGORITHMS):
            raise ValueError(DRAFT_QUANTIZATION_NEEDS_LEARNED_DRAFT)
        if args.speculative_dflash_draft_window_size is not None and algorithm != "DFLASH":
            raise ValueError("speculative_dflash_draft_window_size limits a DFlash draft's context: it needs "
                             "speculative_algorithm='DFLASH'")
        if algorithm is None:
            return None
        ngram = NgramConfig(
            max_window=_given(args.speculative_ngram_max_match_window_size, NgramConfig.max_window),
            min_window=_given(args.speculative_ngram_min_match_window_size, NgramConfig.min_window),
            max_branches=_given(args.speculative_ngram_max_bfs_breadth, NgramConfig.max_branches),
        )
        float_cpu = cpu_target and not quantized_cpu_target and algorithm in HYBRID_ALGORITHMS
        max_verify = _given(args.speculative_max_verify_tokens, FLOAT_CPU_MAX_VERIFY_NODES if float_cpu else None)
        common = dict(grammar_aware=args.speculative_grammar_aware, max_verify_nodes=max_verify,
                      min_draft_prob_grows=float_cpu and args.speculative_draft_min_prob is None,
                      measured_payoff=(algorithm in HYBRID_ALGORITHMS
                                       and (cpu_target if args.speculative_measured_payoff is None
                                            else args.speculative_measured_payoff)),
                      free_text_draft_batch=QUANTIZED_FREE_TEXT_DRAFT_BATCH if quantized_cpu_target else None,
                      draft_model_path=args.speculative_draft_model_path,
                      draft_runner=args.speculative_draft_runner, cuda_graph=not args.disable_cuda_graph)
        if algorithm == "EAGLE":
            base = QUANTIZED_EAGLE if quantized_cpu_target else EagleParams()
            eagle = EagleParams(num_steps=_given(args.speculative_num_steps, base.num_steps),
                                topk=_given(args.speculative_eagle_topk, base.topk),
                                tree_nodes=_given(args.speculative_num_draft_tokens, base.tree_nodes))
            path = _given(args.speculative_hybrid_ngram_tokens,
                          QUANTIZED_HYBRID_PATH_NODES if quantized_cpu_target else HYBRID_PATH_NODES)
            # The hybrid's n-gram path is one branch (breadth 1) matched with the same windows.
            return cls("EAGLE", eagle.tree_nodes + path, eagle=eagle, ngram=ngram, hybrid_path_nodes=path,
                       min_draft_prob=_given(args.speculative_draft_min_prob, EAGLE_MIN_DRAFT_PROB), **common)
        if algorithm == "DFLASH":
            base = QUANTIZED_DFLASH if quantized_cpu_target else DFlashParams()
            dflash = DFlashParams(block_size=_given(args.speculative_num_draft_tokens, base.block_size),
                                  window=args.speculative_dflash_draft_window_size,
                                  topk=_given(args.speculative_eagle_topk, base.topk),
                                  grammar_topk=_given(args.speculative_eagle_topk, base.grammar_topk),
                                  forced_tail=base.forced_tail)
            # The n-gram path as EAGLE's: with the confidence cut it beat the block alone on JSON schemas
            # (1.6x) and on GSM8K (1.1x) with float weights (bench/RESULTS.md, session 16).
            path = _given(args.speculative_hybrid_ngram_tokens,
                          QUANTIZED_HYBRID_PATH_NODES if quantized_cpu_target else HYBRID_PATH_NODES)
            tiled = tiled_bf16_target and float_cpu
            width = tiled and args.speculative_eagle_topk is None
            cut = tiled and args.speculative_draft_min_prob is None
            alone = LoneTree(topk=TILED_BF16_ALONE_TOPK if width else None,
                             min_draft_prob=TILED_BF16_ALONE_MIN_DRAFT_PROB if cut else None,
                             grammar_topk=TILED_BF16_ALONE_GRAMMAR_TOPK if width else None,
                             grammar_min_draft_prob=TILED_BF16_ALONE_GRAMMAR_MIN_DRAFT_PROB if cut else None,
                             learned_nodes=(TILED_ROWS if tiled and args.speculative_max_verify_tokens is None
                                            else None))
            return cls("DFLASH", dflash.block_size + path, ngram=ngram, dflash=dflash, hybrid_path_nodes=path,
                       min_draft_prob=_given(args.speculative_draft_min_prob, DFLASH_MIN_DRAFT_PROB), alone=alone,
                       **common)
        return cls(algorithm, _given(args.speculative_num_draft_tokens, NGRAM_TREE_NODES), ngram=ngram, **common)

    @classmethod
    def for_guided(cls, args, quantized_cpu_target: bool = False, cpu_target: bool = False,
                   free_text: bool = False, tiled_bf16_target: bool = False) -> "SpecConfig":
        """What an engine without ``speculative_algorithm`` runs for requests that bring a prediction or decode
        under a grammar: NGRAM's trees (its arguments, ``speculative_num_draft_tokens``, the n-gram windows and
        ``speculative_grammar_aware``, apply) for those requests alone; every other decode batch is plain.
        ``free_text``: a request without either also drafts while it decodes alone, with DFLASH's defaults for this
        target (the draft at ``speculative_draft_model_path``, else the one shipped for the default model)."""
        # (the draft's weights' method is the free-text draft's: NGRAM's trees have no learned draft)
        config = cls.from_args(replace(args, speculative_algorithm="NGRAM", speculative_draft_model_quantization="auto"),
                               quantized_cpu_target, cpu_target)
        solo = None
        if free_text:  # speculative_num_draft_tokens sizes the NGRAM trees: the block is DFLASH's default
            solo = cls.from_args(replace(args, speculative_algorithm="DFLASH", speculative_num_draft_tokens=None),
                                 quantized_cpu_target, cpu_target, tiled_bf16_target)
        # Free text beside a guided request verifies its root alone, whatever the batch: the free-text rule at 0.
        return replace(config, guided_only=True, free_text_draft_batch=0, solo=solo)


# The engine's speculative arguments that take a number, and the least value each may take.
_LEAST = {"speculative_num_steps": 1, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 1,
          "speculative_ngram_min_match_window_size": 1, "speculative_ngram_max_match_window_size": 1,
          "speculative_ngram_max_bfs_breadth": 1, "speculative_hybrid_ngram_tokens": 0,
          "speculative_max_verify_tokens": 1, "speculative_dflash_draft_window_size": 1}
# ... and the most: far past any tree that pays, and small enough that a draft's steps, a tree's verify rows and
# its KV scratch stay ordinary sizes (a block of 100,000 drafts built an engine that refused every prompt; 5,000
# EAGLE steps took a minute for 16 tokens).
_MOST = {"speculative_num_steps": 64, "speculative_eagle_topk": 64, "speculative_num_draft_tokens": 256,
         "speculative_ngram_min_match_window_size": 1024, "speculative_ngram_max_match_window_size": 1024,
         "speculative_ngram_max_bfs_breadth": 256, "speculative_hybrid_ngram_tokens": 256}


def _check_draft_runner(value: str) -> None:
    if value not in DRAFT_RUNNERS:
        raise ValueError(f"speculative_draft_runner must be one of {', '.join(DRAFT_RUNNERS)}, got {value!r}")


def _given(value, default):
    return default if value is None else value
