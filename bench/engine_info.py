"""What a benchmark reports about an engine it ran: the configuration in effect (the engine's defaults
filled in) and its running speculative totals."""
from __future__ import annotations


def spec_totals(engine) -> tuple[int, int] | None:
    """The engine's running (verify forwards, accepted tokens); None without speculation. Read it
    before and after a stretch of work: the difference is that stretch's."""
    stats = engine.get_server_info()["stats"]
    if "spec_verify_ct" not in stats:
        return None
    return stats["spec_verify_ct"], stats["spec_accepted_tokens"]


def tree_nodes_since_reset(engine, reset: bool = False) -> float | None:
    """The mean nodes of a request's verify tree (root included) since the engine's timings were last reset
    (``reset``: start them afresh after reading); None without speculation or where nothing was verified."""
    phases = engine.get_server_info(reset_timings=reset)["stats"].get("spec_phases")
    return phases["tree_nodes"] if phases and phases.get("iterations") else None


def accept_length(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Accepted tokens / verify forwards between two ``spec_totals`` readings (None: no speculation,
    or no verify forward in between)."""
    if before is None or after is None or after[0] == before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def describe_engine(engine) -> dict:
    """dtype, quantization, device, request limit and speculative settings as the engine resolved them."""
    worker = engine.worker
    desc = {"dtype": str(worker.runner.dtype).removeprefix("torch."), "quantization": worker.runner.quantization,
            "device": str(worker.device),
            "max_running_requests": engine.args.max_running_requests, "page_size": engine.args.page_size,
            "overlap_schedule": engine.loop.overlap, "speculative": None}
    speculator = worker.speculator
    spec = speculator.cfg if speculator is not None else None
    desc["guided_drafting"] = spec is not None and spec.guided_only
    desc["free_text_drafting"] = spec is not None and spec.solo is not None
    if desc["guided_drafting"]:  # an engine without speculative_algorithm: "speculative" is off
        spec = None
    if spec is not None:  # reported under the engine arguments' names (SGLang's)
        if spec.algorithm == "EAGLE":
            desc["speculative"] = {"algorithm": "EAGLE", "num_steps": spec.eagle.num_steps, "topk": spec.eagle.topk,
                                   "num_draft_tokens": spec.eagle.tree_nodes,
                                   "hybrid_ngram_tokens": spec.hybrid_path_nodes}
        elif spec.algorithm == "DFLASH":
            desc["speculative"] = {"algorithm": "DFLASH", "num_draft_tokens": spec.dflash.block_size,
                                   "topk": spec.dflash.topk, "grammar_topk": spec.dflash.grammar_topk,
                                   "draft_window_size": spec.dflash.window,
                                   "hybrid_ngram_tokens": spec.hybrid_path_nodes,
                                   "alone_topk": spec.alone.topk, "alone_min_draft_prob": spec.alone.min_draft_prob,
                                   "alone_grammar_topk": spec.alone.grammar_topk,
                                   "alone_grammar_min_draft_prob": spec.alone.grammar_min_draft_prob,
                                   "alone_learned_nodes": spec.alone.learned_nodes}
        else:
            desc["speculative"] = {"algorithm": spec.algorithm, "num_draft_tokens": spec.max_tree_nodes,
                                   "max_bfs_breadth": spec.ngram.max_branches,
                                   "match_window": [spec.ngram.min_window, spec.ngram.max_window]}
        desc["speculative"]["max_verify_tokens"] = spec.max_verify_nodes
        if spec.algorithm in ("EAGLE", "DFLASH"):
            desc["speculative"]["draft_model_quantization"] = spec.draft_quantization
    return desc


def speculation_str(desc: dict) -> str:
    """A ``describe_engine`` dict's speculation in one line: its algorithm, or "off" and whether guided
    requests still draft (an engine without ``speculative_algorithm``)."""
    guided = ""
    if desc.get("guided_drafting"):
        guided = " (guided drafting: NGRAM trees for requests with a prediction or a grammar" + (
            "; DFLASH for free text decoding alone)" if desc.get("free_text_drafting") else ")")
    return spec_str(desc["speculative"]) + guided


def spec_str(spec: dict | None) -> str:
    """``describe_engine(...)["speculative"]`` in one line."""
    if spec is None:
        return "off"
    cap = f", at most {spec['max_verify_tokens']} nodes per verify" if spec.get("max_verify_tokens") else ""
    if spec["algorithm"] == "EAGLE":
        hybrid = f" + {spec['hybrid_ngram_tokens']} n-gram nodes" if spec.get("hybrid_ngram_tokens") else ""
        return (f"EAGLE num_steps={spec['num_steps']} topk={spec['topk']} num_draft_tokens={spec['num_draft_tokens']}"
                f"{hybrid}{cap}{_draft_weights(spec)}")
    if spec["algorithm"] == "DFLASH":
        window = f" window={spec['draft_window_size']}" if spec.get("draft_window_size") else ""
        hybrid = f" + {spec['hybrid_ngram_tokens']} n-gram nodes" if spec.get("hybrid_ngram_tokens") else ""
        grammar = (f" ({spec['grammar_topk']} under a grammar)"
                   if spec.get("grammar_topk", spec["topk"]) != spec["topk"] else "")
        alone = (_alone_str(spec, "without a grammar", "alone_topk", "alone_min_draft_prob", spec["topk"])
                 + _alone_str(spec, "under a grammar", "alone_grammar_topk", "alone_grammar_min_draft_prob",
                              spec.get("grammar_topk", spec["topk"])))
        tile = (f", learned drafts alone within {spec['alone_learned_nodes']} nodes"
                if spec.get("alone_learned_nodes") is not None else "")
        return (f"DFLASH block={spec['num_draft_tokens']} topk={spec['topk']}{grammar}{alone}{window}{hybrid}{cap}"
                f"{tile}{_draft_weights(spec)}")
    return (f"{spec['algorithm']} num_draft_tokens={spec['num_draft_tokens']} "
            f"max_bfs_breadth={spec['max_bfs_breadth']}{cap}")


def _alone_str(spec: dict, which: str, width_key: str, cut_key: str, width: int) -> str:
    """A DFLASH request's own tree width and cut when it decodes alone (empty where neither is its own)."""
    if spec.get(width_key) is None and spec.get(cut_key) is None:
        return ""
    return (f"; alone {which} topk={spec.get(width_key) or width}"
            + (f" cut={spec[cut_key]}" if spec.get(cut_key) is not None else ""))


def _draft_weights(spec: dict) -> str:
    method = spec.get("draft_model_quantization", "target")
    return "" if method == "target" else f", {method or 'float'} draft weights"
