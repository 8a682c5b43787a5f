"""Grammar-constrained decoding over xgrammar: compile cache, per-request matcher, bitmasks."""

from specjet.grammar.backend import GRAMMAR_KINDS, JSON_SCHEMA_OPTIONS, GrammarBackend, GrammarError
from specjet.grammar.matcher import (RequestGrammar, allocate_token_bitmask, apply_token_bitmask_, bitmask_allows,
                                    fill_token_bitmasks)
from specjet.grammar.tree_mask import TreeMasks, mask_draft_tree

__all__ = [
    "GRAMMAR_KINDS",
    "JSON_SCHEMA_OPTIONS",
    "GrammarBackend",
    "GrammarError",
    "RequestGrammar",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "bitmask_allows",
    "fill_token_bitmasks",
    "mask_draft_tree",
    "TreeMasks",
]
