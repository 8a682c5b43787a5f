"""The verifier's sampled paths when some trees are their root alone: such a request draws as plain sampling
does (``sample``: an empty tree's bonus is the inverse-CDF draw over the root's filtered distribution by the
request's first coin), and the requests with drafts beside it get what they get alone."""
from __future__ import annotations

import torch

from specjet.kernels.sampling import SamplingTensors, sample
from specjet.spec_v2.tree_verifier import TreeVerifier, VerifyInput, offsets_of


def _params(rows: list[tuple[float, int, float]]) -> SamplingTensors:
    return SamplingTensors.from_lists([t for t, _, _ in rows], [k for _, k, _ in rows], [p for _, _, p in rows],
                                      [0.0] * len(rows))


def test_root_only_trees_draw_as_plain_sampling_beside_drafted_trees():
    gen = torch.Generator().manual_seed(4)
    vocab = 500
    reqs = [
        VerifyInput(0, 10, [7], [-1], torch.tensor([0.37])),  # root alone, sampled
        VerifyInput(1, 12, [3, 11, 12, 13], [-1, 0, 0, 1], torch.rand(4, generator=gen)),  # a drafted tree
        VerifyInput(2, 9, [5], [-1], None),  # root alone, greedy
        VerifyInput(3, 20, [8], [-1], torch.tensor([0.91])),  # root alone, sampled, top-k
    ]
    sizes = [len(r.tokens) for r in reqs]
    offsets = offsets_of(sizes)
    logits = torch.randn(sum(sizes), vocab, generator=gen) * 3
    # Make the drafted tree's first child the target's likely token, so its path is not just the root.
    logits[offsets[1], 11] = 12.0
    rows = [(0.8, -1, 0.9), (1.0, -1, 1.0), (0.0, -1, 1.0), (0.7, 5, 1.0)]
    paths = TreeVerifier._sampled_paths(reqs, logits, offsets, sizes, _params(rows), "cpu")

    for i in (0, 3):
        alone = sample(logits[offsets[i]:offsets[i] + 1], _params([rows[i]]), reqs[i].uniforms[:1])
        assert paths[i] == ([0], int(alone))
    assert paths[2] == ([0], int(logits[offsets[2]].argmax()))
    drafted = TreeVerifier._sampled_paths([reqs[1]], logits[offsets[1]:offsets[1] + 4], [0], [4], _params([rows[1]]),
                                          "cpu")
    assert paths[1] == drafted[0] and paths[1][0][:2] == [0, 1]
