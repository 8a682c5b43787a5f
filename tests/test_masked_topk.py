"""kernels/masked_topk.py: a drafter's best grammar-allowed tokens with renormalised log-probs. The
torch reference against a plain-Python oracle, and the C++ op against the reference."""
from __future__ import annotations

import math

import pytest
import torch

from specjet.kernels import cpu_ops
from specjet.kernels.masked_topk import masked_topk_logp, masked_topk_logp_reference, masked_topk_row


def random_case(seed: int, rows: int, cols: int, vocab: int, density: float, hot: bool):
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(rows, cols, generator=gen)
    bits = torch.rand(rows, vocab, generator=gen) < density
    bits[0] = False if rows > 2 else bits[0]  # a row the grammar allows nothing in
    words = torch.zeros(rows, vocab // 32, dtype=torch.int64)
    for b in range(32):
        words |= bits[:, b::32].to(torch.int64) << b
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    token_ids = torch.randperm(vocab, generator=gen)[:cols] if hot else None
    return logits, bitmask, token_ids, bits


def oracle(logits, bits, token_ids, k):
    """Plain Python floats: every allowed (token, logit), sorted; log-probs over the allowed ones."""
    out = []
    for r in range(logits.shape[0]):
        pairs = [(int(token_ids[c]) if token_ids is not None else c, float(logits[r, c]))
                 for c in range(logits.shape[1]) if bits[r, int(token_ids[c]) if token_ids is not None else c]]
        if not pairs:
            out.append(([], 0))
            continue
        top = max(v for _, v in pairs)
        log_total = top + math.log(sum(math.exp(v - top) for _, v in pairs))
        best = sorted(pairs, key=lambda p: -p[1])[:k]
        out.append(([(t, v - log_total) for t, v in best], len(pairs)))
    return out


@pytest.mark.parametrize("impl", ["reference", "dispatch"])
@pytest.mark.parametrize("hot,density,k", [(True, 0.3, 3), (False, 0.02, 4), (True, 0.001, 5), (False, 0.9, 1)])
def test_matches_a_plain_python_oracle(impl, hot, density, k):
    if impl == "dispatch" and cpu_ops.extension() is None:
        pytest.skip("the C++ CPU ops are not built")
    logits, bitmask, token_ids, bits = random_case(3, rows=4, cols=300 if hot else 256, vocab=512,
                                                   density=density, hot=hot)
    fn = masked_topk_logp_reference if impl == "reference" else masked_topk_logp
    ids, logp, count = fn(logits, bitmask, token_ids, k)
    assert ids.shape == logp.shape == (4, k)
    for r, (best, allowed) in enumerate(oracle(logits, bits, token_ids, k)):
        assert int(count[r]) == allowed
        got = [(int(i), float(lp)) for i, lp in zip(ids[r], logp[r]) if i >= 0]
        assert [t for t, _ in got] == [t for t, _ in best]
        assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(got, best))
        assert all(i == -1 for i in ids[r, len(best):].tolist())
        assert all(lp == float("-inf") for lp in logp[r, len(best):].tolist())


@pytest.mark.parametrize("impl", ["reference", "dispatch"])
@pytest.mark.parametrize("hot,k", [(True, 3), (False, 1), (False, 5)])
def test_without_a_bitmask_every_column_is_allowed(impl, hot, k):
    """An unconstrained drafter's top-k with log-probabilities over all of its columns."""
    if impl == "dispatch" and cpu_ops.extension() is None:
        pytest.skip("the C++ CPU ops are not built")
    logits, _, token_ids, _ = random_case(4, rows=3, cols=300 if hot else 256, vocab=512, density=1.0, hot=hot)
    logits[2, 100:] = float("-inf")  # a row with masked-out logits
    fn = masked_topk_logp_reference if impl == "reference" else masked_topk_logp
    ids, logp, count = fn(logits, None, token_ids, k)
    every = torch.ones(3, 512, dtype=torch.bool)
    for r, (best, allowed) in enumerate(oracle(logits, every, token_ids, k)):
        assert int(count[r]) == allowed == logits.shape[1]
        got = [(int(i), float(lp)) for i, lp in zip(ids[r], logp[r])]
        assert [t for t, _ in got] == [t for t, _ in best]
        assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(got, best))


@pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")
@pytest.mark.parametrize("rows,cols", [(7, 8192), (2, 1000), (1, 63)])
def test_the_cpp_op_without_a_bitmask_equals_the_reference(rows, cols):
    """A block's positions over the packaged draft's hot columns, and sizes that leave partial blocks
    of the op's 64-column scan."""
    gen = torch.Generator().manual_seed(cols)
    logits = 3 * torch.randn(rows, cols, generator=gen)
    logits[0, cols // 2] = 40.0  # one sure token
    token_ids = torch.randperm(49152, generator=gen)[:cols]
    ids, logp, count = masked_topk_logp(logits, None, token_ids, 3)
    ref_ids, ref_logp, ref_count = masked_topk_logp_reference(logits, None, token_ids, 3)
    assert torch.equal(ids, ref_ids) and torch.equal(count, ref_count)
    assert torch.allclose(logp, ref_logp, atol=1e-5, rtol=0)


@pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")
@pytest.mark.parametrize("seed", range(6))
def test_the_cpp_op_equals_the_reference_at_a_drafts_sizes(seed):
    """8192 hot columns of a 49152-token vocabulary, as the packaged DFlash draft has."""
    hot, k = seed % 2 == 0, 1 + seed % 4
    logits, bitmask, token_ids, _ = random_case(seed, rows=3, cols=8192 if hot else 49152, vocab=49152,
                                                density=[0.5, 0.01, 0.0005][seed % 3], hot=hot)
    logits[1, :7] = float("-inf")  # masked-out logits the grammar still allows
    ids, logp, count = masked_topk_logp(logits, bitmask, token_ids, k)
    ref_ids, ref_logp, ref_count = masked_topk_logp_reference(logits, bitmask, token_ids, k)
    assert torch.equal(ids, ref_ids) and torch.equal(count, ref_count)
    assert torch.allclose(logp, ref_logp, atol=1e-5, rtol=0) or torch.equal(logp, ref_logp)


def test_argument_checks():
    if cpu_ops.extension() is None:
        pytest.skip("the C++ CPU ops are not built")
    logits, bitmask, _, _ = random_case(0, rows=2, cols=64, vocab=64, density=0.5, hot=False)
    with pytest.raises(RuntimeError, match="k must be"):
        masked_topk_logp(logits, bitmask, None, 0)
    with pytest.raises(RuntimeError, match="one row per logits row"):
        masked_topk_logp(logits, bitmask[:1], None, 2)
    with pytest.raises(RuntimeError, match="token_ids"):
        masked_topk_logp(logits, bitmask, torch.arange(10), 2)
    with pytest.raises(RuntimeError, match="k must be"):
        masked_topk_row(logits[0], bitmask[:1], None, 0)
    with pytest.raises(RuntimeError, match=r"\[1, W\]"):
        masked_topk_row(logits[0], bitmask, None, 2)
    with pytest.raises(RuntimeError, match="token_ids"):
        masked_topk_row(logits[0], bitmask[:1], torch.arange(10), 2)


@pytest.mark.parametrize("impl", ["reference", "dispatch"])
@pytest.mark.parametrize("cols,masked", [(4, False), (4, True), (200, False), (200, True)])
def test_a_nan_among_the_allowed_logits_leaves_the_row_no_candidates(impl, cols, masked, monkeypatch):
    """A drafter's row whose allowed logits hold a NaN has no softmax: no candidates (ids -1, log-probs -inf) on
    every path, so a draft tree does not depend on the device. A NaN in a forbidden column changes nothing."""
    if impl == "dispatch" and cpu_ops.extension() is None:
        pytest.skip("the C++ CPU ops are not built")
    if impl == "reference":
        monkeypatch.setattr(cpu_ops, "extension", lambda: None)
    logits = torch.arange(cols, dtype=torch.float32)[None].repeat(2, 1) / 10
    logits[0, cols // 2] = float("nan")  # row 0: the NaN allowed
    logits[1, 1] = float("nan")  # row 1: the NaN in a column its mask forbids (or allowed without a mask)
    words = torch.full((2, (cols + 31) // 32), -1, dtype=torch.int32)
    words[1, 0] = -1 ^ 2  # token 1 forbidden in row 1
    bitmask = words if masked else None
    ids, logp, allowed = masked_topk_logp(logits, bitmask, None, 3)
    assert ids[0].tolist() == [-1, -1, -1] and torch.isneginf(logp[0]).all() and int(allowed[0]) == cols
    assert masked_topk_row(logits[0], None if bitmask is None else bitmask[:1], None, 3) == ([], cols)
    if masked:  # the forbidden NaN is not among the allowed: the row's three best, renormalised over the rest
        rest = torch.cat([logits[1, :1], logits[1, 2:]]).double()
        assert ids[1].tolist() == sorted([0, *range(2, cols)], reverse=True)[:3] and int(allowed[1]) == cols - 1
        torch.testing.assert_close(logp[1].double(), rest[-3:].flip(0) - torch.logsumexp(rest, 0), rtol=0, atol=1e-5)
    else:
        assert ids[1].tolist() == [-1, -1, -1]


@pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")
@pytest.mark.parametrize("cols", [8192, 1000, 17, 5])
def test_tokens_outside_the_bitmask_are_not_allowed(cols):
    """Hot columns whose token lies past the bitmask's 32 W tokens, or is negative, are forbidden (and their
    bitmask word is not read), at column counts with and without a tail past whole groups of 16."""
    gen = torch.Generator().manual_seed(cols)
    logits = 3 * torch.randn(2, cols, generator=gen)
    token_ids = torch.randint(-40, 1100, (cols,), generator=gen)
    token_ids[: min(cols, 3)] = torch.tensor([2000, -1, 1023][: min(cols, 3)])  # past, negative, last covered
    logits[:, : min(cols, 2)] = 50.0  # the best columns are the two outside the mask
    _, bitmask, _, _ = random_case(cols, rows=2, cols=cols, vocab=1024, density=0.6, hot=False)
    ids, logp, count = masked_topk_logp(logits, bitmask, token_ids, 3)
    ref_ids, ref_logp, ref_count = masked_topk_logp_reference(logits, bitmask, token_ids, 3)
    assert torch.equal(ids, ref_ids) and torch.equal(count, ref_count)
    assert torch.allclose(logp, ref_logp, atol=1e-5, rtol=0)
    assert 2000 not in ids.flatten().tolist() and bool((ids[ids >= 0] < 1024).all())


@pytest.mark.parametrize("impl", ["reference", "dispatch"])
@pytest.mark.parametrize("seed", range(6))
def test_one_row_as_host_values_is_that_row_of_the_tensor_op(seed, impl, monkeypatch):
    """masked_topk_row (a grammar-aware drafter's call per block position) gives row r's pairs and allowed
    count of masked_topk_logp exactly, dense and sparse masks, hot and full columns, with and without a mask."""
    if impl == "reference":
        monkeypatch.setattr(cpu_ops, "extension", lambda: None)
    elif cpu_ops.extension() is None:
        pytest.skip("the C++ CPU ops are not built")
    hot, k = seed % 2 == 0, 1 + seed % 3
    logits, bitmask, token_ids, _ = random_case(seed, rows=3, cols=8192 if hot else 4096, vocab=8192,
                                                density=[0.5, 0.01, 0.0005][seed % 3], hot=hot)
    for mask in (bitmask, None):
        ids, logp, count = masked_topk_logp(logits, mask, token_ids, k)
        for r in range(3):
            best, allowed = masked_topk_row(logits[r], None if mask is None else mask[r:r + 1], token_ids, k)
            assert allowed == int(count[r])
            want = [(t, lp) for t, lp in zip(ids[r].tolist(), logp[r].tolist()) if t >= 0]
            assert [t for t, _ in best] == [t for t, _ in want]
            assert all(math.isclose(a, b, rel_tol=0, abs_tol=1e-6) for (_, a), (_, b) in zip(best, want))
    assert masked_topk_row(logits[0], bitmask[0:1], token_ids, k) == ([], 0)  # row 0 allows nothing


@pytest.mark.parametrize("seed", range(4))
def test_masked_argmax_is_xgrammars_mask_then_torch_argmax(seed):
    """Greedy decoding's token under a grammar: the C++ pass and the torch reference give what the plain
    path computed, xgrammar's apply_token_bitmask on the masked rows then torch.argmax, on rows with
    ties, NaNs, -inf, nothing allowed, unmasked rows and columns past the mask's width."""
    import xgrammar as xgr

    rows, vocab = 7, 256
    logits, bitmask, _, bits = random_case(seed, rows, vocab + 5, vocab, 0.2, hot=False)  # 5 columns unmasked
    logits = logits.round()  # many ties
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    logits[3, :] = 7.0  # a row of equal values
    masked = torch.tensor([True, True, True, True, False, True, False])
    expected = logits.clone()
    with pytest.warns(UserWarning, match="left unmasked"):  # xgrammar on the 5 columns past the mask
        xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[r for r in range(rows) if masked[r]], backend="cpu")
    expected = expected.argmax(-1)
    from specjet.kernels.masked_topk import masked_argmax, masked_argmax_reference

    assert torch.equal(masked_argmax_reference(logits, bitmask, masked), expected)
    if cpu_ops.extension() is None:
        pytest.skip("the C++ extension is not built")
    assert torch.equal(masked_argmax(logits, bitmask, masked), expected)



def test_masked_argmax_on_sparse_masks():
    """Masks that allow a handful of tokens (the C++ pass then visits only their columns): NaNs and
    maxima under forbidden columns are ignored, column 0 forbidden or allowed, a row allowing nothing,
    only the last covered column, and a larger value past the mask's width."""
    from specjet.kernels.masked_topk import masked_argmax, masked_argmax_reference

    if cpu_ops.extension() is None:
        pytest.skip("the C++ extension is not built")
    vocab, width = 200, 160  # columns 160 .. 199 lie past the mask (5 words)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, vocab, generator=gen)
    allowed = [[5, 40, 77], [0, 31, 32], [], [159], [1, 2, 3], [64, 70], [12], [33, 140]]
    bitmask = torch.zeros(8, width // 32, dtype=torch.int32)
    for r, cols in enumerate(allowed):
        for c in cols:
            bitmask[r, c // 32] |= torch.tensor(1 << (c % 32)).to(torch.int32)
    logits[:, 160:] = -50.0
    logits[0, 6] = float("nan")  # forbidden: ignored
    logits[0, 41] = 1e9  # forbidden maximum: ignored
    logits[1, 0] = 100.0  # allowed column 0 is the maximum
    logits[4, 0] = 1e9  # forbidden column 0
    logits[5, 70] = float("nan")  # an allowed NaN after a value: the NaN wins
    logits[6, 199] = 1e3  # past the mask: unmasked, the maximum
    logits[7, 33] = logits[7, 140] = 4.0  # a tie: the first wins
    masked = torch.ones(8, dtype=torch.bool)
    expected = masked_argmax_reference(logits, bitmask, masked)
    assert expected.tolist()[:2] == [max(allowed[0], key=lambda c: logits[0, c]), 0]
    assert expected[5] == 70 and expected[6] == 199 and expected[7] == 33
    assert torch.equal(masked_argmax(logits, bitmask, masked), expected)


@pytest.mark.parametrize("density", [0.5, 0.97])
def test_masked_argmax_on_dense_masks(density):
    """Masks allowing thousands of columns (the C++ pass then skips 64-column blocks whose largest value
    cannot win): ties across blocks, a forbidden maximum, NaNs and infinities allowed or forbidden."""
    from specjet.kernels.masked_topk import masked_argmax, masked_argmax_reference

    if cpu_ops.extension() is None:
        pytest.skip("the C++ extension is not built")
    rows, vocab = 9, 5000
    gen = torch.Generator().manual_seed(int(density * 100))
    logits = (torch.randn(rows, vocab + 7, generator=gen) * 3).round()  # many ties; 7 columns past the mask
    allowed = torch.rand(rows, vocab, generator=gen) < density
    allowed[:, 100] = False
    logits[0, 100] = 1e9  # a forbidden maximum
    logits[1, 4000] = float("nan")  # a forbidden NaN (row 1 has no allowed NaN)
    allowed[1, 4000] = False
    allowed[2, 3000] = True
    logits[2, 3000] = float("nan")  # an allowed NaN
    logits[3, 2500] = float("inf")
    allowed[3, 2500] = True  # an allowed infinity
    logits[4] = float("-inf")
    logits[4, 100:110] = 2.0  # forbidden at 100; allowed ones in 101 .. 109 tie
    allowed[4, 101:110] = True
    logits[5] = 1.0  # all equal: the first allowed column
    logits[6, 1200] = logits[6, 2600] = 50.0  # a tie of the maxima in far blocks
    allowed[6, [1200, 2600]] = True
    logits[7, 0] = 99.0  # column 0 the maximum, forbidden
    allowed[7, 0] = False
    padded = torch.zeros(rows, 32 * ((vocab + 31) // 32), dtype=torch.bool)
    padded[:, :vocab] = allowed
    weights = (1 << torch.arange(32, dtype=torch.int64))
    bitmask = (padded.view(rows, -1, 32).to(torch.int64) * weights).sum(-1)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    masked = torch.ones(rows, dtype=torch.bool)
    masked[8] = False  # an unmasked row: the block pass over everything
    expected = masked_argmax_reference(logits, bitmask, masked)
    assert expected[0] != 100 and expected[2] == 3000 and expected[3] == 2500 and expected[4] == 101
    assert expected[6] == 1200 and expected[7] != 0
    assert torch.equal(masked_argmax(logits, bitmask, masked), expected)
