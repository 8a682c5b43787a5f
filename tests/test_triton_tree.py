"""The Triton draft-tree kernels against their torch references, on random batched trees.

The kernels run compiled on a CUDA GPU when one is present, else under Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors. The flag is
read when a kernel is decorated, i.e. when the kernel module is first imported, and another test
may already have imported triton in this process; so the checks run once in a subprocess of this
very file (``--kernel-worker``) with the flag set, and report one verdict per case back as JSON.
Every output here is integer (or bool), so "equal" means exactly equal.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from triton_interpreter import report_cases, run_kernel_worker, to_kernel_device
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the worker runs this file as a script

from test_tree_kernels import (  # noqa: E402
    random_parents,
    targets_following_tree,
)


@dataclass
class Case:
    kernel: str  # "build_tree" | "greedy"
    batch: int
    num_nodes: int
    vocab: int = 20
    chain_bias: float = 0.5  # 1.0 = every tree a chain
    seed: int = 0


CASES = {
    "build_tree_root_only": Case("build_tree", 3, 1),
    "build_tree_small": Case("build_tree", 4, 6),
    "build_tree_17": Case("build_tree", 5, 17, seed=1),
    "build_tree_64": Case("build_tree", 3, 64, seed=2),
    "build_tree_chain_40": Case("build_tree", 2, 40, chain_bias=1.0),
    "greedy_root_only": Case("greedy", 4, 1),
    "greedy_small": Case("greedy", 8, 6, seed=3),
    "greedy_17": Case("greedy", 6, 17, seed=4),
    "greedy_64": Case("greedy", 3, 64, seed=5),
}


def build_inputs(case: Case) -> dict:
    gen = torch.Generator().manual_seed(case.seed)
    parents = random_parents(case.batch, case.num_nodes, gen, chain_bias=case.chain_bias)
    tokens = torch.randint(0, case.vocab, (case.batch, case.num_nodes), generator=gen)
    seq_lens = torch.randint(0, 1000, (case.batch,), generator=gen)
    inputs = dict(parents=parents, tokens=tokens, seq_lens=seq_lens)
    if case.kernel == "greedy":
        inputs["target_ids"] = targets_following_tree(parents, tokens, case.vocab, gen)
    return inputs


def run_case(case: Case) -> dict:
    """Both implementations on one case; the verdict as a JSON-able dict."""
    from specjet.kernels.tree import build_tree_reference
    from specjet.kernels.tree_verify import verify_tree_greedy_reference
    from specjet.kernels.triton_tree import build_tree_triton, verify_tree_greedy_triton

    inputs = to_kernel_device(build_inputs(case))
    tree = build_tree_reference(inputs["parents"], inputs["seq_lens"])
    if case.kernel == "build_tree":
        got = build_tree_triton(inputs["parents"], inputs["seq_lens"])
        names = ["mask", "depths", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling"]
        mismatched = [n for n in names if not (getattr(got, n).dtype == getattr(tree, n).dtype
                                               and torch.equal(getattr(got, n), getattr(tree, n)))]
        if got.max_depth != tree.max_depth:
            mismatched.append("max_depth")
        return {"mismatched": mismatched, "max_depth": tree.max_depth}
    args = (inputs["tokens"], tree, inputs["target_ids"])
    ref, got = verify_tree_greedy_reference(*args), verify_tree_greedy_triton(*args)
    names = ["accepted_nodes", "accept_lens", "bonus_ids"]
    mismatched = [n for n, r, g in zip(names, ref, got) if not (r.dtype == g.dtype and torch.equal(r, g))]
    # How deep the paths went, so a case that accepts nothing cannot pass unnoticed.
    return {"mismatched": mismatched, "longest_path": int(ref[1].max()), "max_depth": tree.max_depth}


def _kernel_worker() -> None:
    report_cases(CASES, run_case)


@pytest.fixture(scope="module")
def kernel_report() -> dict:
    return run_kernel_worker(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_tree_kernel_matches_reference(kernel_report, name):
    result = kernel_report[name]
    assert "error" not in result, result.get("error")
    assert result["mismatched"] == [], result
    case = CASES[name]
    if case.kernel == "greedy" and case.num_nodes > 1:
        assert result["longest_path"] >= 3, result  # the walk went past the root's children


if __name__ == "__main__" and "--kernel-worker" in sys.argv:
    _kernel_worker()
