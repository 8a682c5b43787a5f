"""Grammar-constrained decoding over xgrammar: compile cache, per-request matcher, bitmasks."""

from specjet.grammar.backend import (GRAMMAR_KINDS, JSON_SCHEMA_OPTIONS, GrammarBackend, GrammarBusyError,
                                    GrammarClosedError, GrammarError, GrammarTimeoutError)
from specjet.grammar.matcher import (RequestGrammar, allocate_token_bitmask, apply_token_bitmask_, bitmask_allows,
                                    bitmask_popcount, empty_token_bitmask, fill_token_bitmasks)
from specjet.grammar.output_check import OutputCheck, check_json_output
from specjet.grammar.schema_rewrite import reachable_required
from specjet.grammar.tree_mask import TreeMasks, mask_draft_tree

__all__ = [
    "GRAMMAR_KINDS",
    "JSON_SCHEMA_OPTIONS",
    "GrammarBackend",
    "GrammarBusyError",
    "GrammarClosedError",
    "GrammarError",
    "GrammarTimeoutError",
    "OutputCheck",
    "RequestGrammar",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "bitmask_allows",
    "bitmask_popcount",
    "check_json_output",
    "empty_token_bitmask",
    "fill_token_bitmasks",
    "mask_draft_tree",
    "reachable_required",
    "TreeMasks",
]
