"""Batched sampling against independent computations of each filter."""
from __future__ import annotations

import pytest
import torch

from specjet.kernels import cpu_ops
from specjet.kernels.sampling import SamplingTensors, filtered_probs, sample, sample_lists, sample_reference


def st(B, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    return SamplingTensors.from_lists([temperature] * B, [top_k] * B, [top_p] * B, [min_p] * B)


def test_greedy_rows_take_the_argmax_even_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    tensors = SamplingTensors.from_lists([0.0, 1.0, 0.0, 0.7], [-1] * 4, [1.0] * 4, [0.0] * 4)
    ids = sample(logits, tensors, torch.rand(4))
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()


def test_filters_match_a_direct_computation():
    torch.manual_seed(1)
    logits = torch.randn(1, 50) * 3
    p = torch.softmax(logits[0] / 0.8, -1)
    order = p.argsort(descending=True)

    probs = filtered_probs(logits, st(1, 0.8, top_k=5))[0]
    assert set(probs.nonzero().flatten().tolist()) == set(order[:5].tolist())
    torch.testing.assert_close(probs[order[:5]], p[order[:5]] / p[order[:5]].sum())

    probs = filtered_probs(logits, st(1, 0.8, top_p=0.6))[0]
    cum = 0.0
    keep = []
    for i in order.tolist():  # smallest prefix of the sorted tokens reaching mass 0.6
        keep.append(i)
        cum += float(p[i])
        if cum >= 0.6:
            break
    assert set(probs.nonzero().flatten().tolist()) == set(keep)

    probs = filtered_probs(logits, st(1, 0.8, min_p=0.2))[0]
    assert set(probs.nonzero().flatten().tolist()) == set((p >= 0.2 * p.max()).nonzero().flatten().tolist())


def test_sampling_follows_the_distribution():
    """Total-variation distance between 20k draws and the softmax is small; a biased sampler fails it."""
    torch.manual_seed(2)
    logits = torch.randn(1, 8)
    probs = torch.softmax(logits[0], -1)
    g = torch.Generator().manual_seed(3)
    n = 20000
    counts = torch.zeros(8)
    u = torch.rand(n, generator=g)
    ids = sample(logits.expand(n, 8).contiguous(), st(n), u)
    counts += torch.bincount(ids, minlength=8)
    tv = 0.5 * (counts / n - probs).abs().sum()
    assert tv < 0.02


def test_same_uniforms_give_same_tokens_whatever_the_batch():
    torch.manual_seed(4)
    logits = torch.randn(3, 200)
    u = torch.rand(3)
    together = sample(logits, st(3, top_p=0.9), u)
    alone = torch.stack([sample(logits[i:i + 1], st(1, top_p=0.9), u[i:i + 1])[0] for i in range(3)])
    assert torch.equal(together, alone)


def test_masked_tokens_are_never_sampled():
    logits = torch.zeros(1000, 10)
    logits[:, :5] = float("-inf")
    ids = sample(logits, st(1000), torch.rand(1000))
    assert (ids >= 5).all()


def _sorted_filter(probs: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Top-k and top-p by sorting each whole row (the direct definition), rows without a filter left whole."""
    out = probs.clone()
    for r, (k, p) in enumerate(zip(top_ks, top_ps)):
        if k <= 0 and p >= 1.0:
            continue
        values, order = probs[r].sort(descending=True)
        drop = torch.arange(len(values)) >= (k if k > 0 else len(values))
        drop |= values.cumsum(0) - values >= p
        out[r] = torch.zeros_like(values).scatter_(0, order, values.masked_fill(drop, 0.0))
    return out


def test_top_k_top_p_from_candidates_equal_the_whole_sort():
    """The filter looks at the best few candidates first and widens only where a row's nucleus or top-k
    reaches past them: the same kept tokens and probabilities as sorting whole rows, for peaked and flat
    rows, nuclei past the first candidates (the widening), a top-k past them, masked columns, rows without
    a filter beside filtered ones, and a vocabulary smaller than the candidates."""
    gen = torch.Generator().manual_seed(3)
    for vocab, scale in ((49152, 6.0), (49152, 0.3), (5000, 2.0), (40, 1.0), (1, 1.0)):
        logits = torch.randn(8, vocab, generator=gen) * scale
        logits[2, : vocab // 2] = float("-inf")  # a grammar-masked row
        top_ks = [0, 5, 0, 300, 0, 2000, 0, 1][:8]
        top_ps = [0.9, 1.0, 0.95, 0.99, 1.0, 0.5, 0.999, 1.0]
        tensors = SamplingTensors.from_lists([0.7] * 8, top_ks, top_ps, [0.0] * 8)
        probs = torch.softmax(logits / 0.7, dim=-1)
        expected = _sorted_filter(probs, top_ks, top_ps)
        expected = expected / expected.sum(-1, keepdim=True)
        assert torch.equal(filtered_probs(logits, tensors), expected), (vocab, scale)


def _cpu_sampler():
    from specjet.kernels import cpu_ops

    ext = cpu_ops.extension()
    if ext is None:
        pytest.skip("the C++ extension is not built")
    return ext


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,scale", [
    (1.0, 0, 1.0, 0.0, 2.0), (0.7, 0, 0.9, 0.0, 2.0), (0.7, 40, 1.0, 0.0, 1.0), (1.3, 0, 1.0, 0.1, 1.0),
    (0.5, 300, 0.95, 0.02, 0.5), (1.0, 0, 0.999, 0.0, 0.2), (1.0, 0, 0.6, 0.05, 2.0), (0.8, 8, 0.7, 0.1, 1.5)])
def test_cpu_sampler_draws_the_reference_distribution(temperature, top_k, top_p, min_p, scale):
    """The C++ draw as a function of the uniform, over a fine grid of uniforms: each token's share of the grid
    is its probability under the reference's filters (to the grid's resolution), nothing outside the
    reference's kept tokens is drawn, and at almost every uniform it is the reference's own token (its weights
    come from its own exp, so a uniform at the edge of two shares may fall either side). Forbidden (-inf)
    columns and a nucleus past the first candidates (the flat rows) included."""
    _cpu_sampler()
    gen = torch.Generator().manual_seed(11)
    vocab, grid = 3000, 4000
    row = torch.randn(vocab, generator=gen) * scale
    row[::3] = float("-inf")
    tensors = SamplingTensors.from_lists([temperature] * grid, [top_k] * grid, [top_p] * grid, [min_p] * grid)
    uniforms = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    logits = row.expand(grid, vocab).contiguous()
    ids = sample(logits, tensors, uniforms.float())
    reference = sample_reference(logits, tensors, uniforms.float())
    probs = filtered_probs(row[None], SamplingTensors.from_lists([temperature], [top_k], [top_p], [min_p]))[0].double()
    shares = torch.bincount(ids, minlength=vocab).double() / grid
    assert set(ids.unique().tolist()) <= set(probs.nonzero().flatten().tolist())
    assert (shares - probs).abs().max() <= 2.0 / grid
    assert (ids == reference).double().mean() >= 0.99


@pytest.mark.parametrize("path", ["reference", "cpu"])
def test_a_huge_temperature_keeps_the_best_tokens_not_the_lowest_ids(path):
    """At a temperature of 1e9 or more every weight rounds to the same float: top-k kept token ids 0..k-1 and a tiny
    top-p token 0 (special tokens), where the model's best tokens are what they keep (ranked by the logits)."""
    if path == "cpu":
        _cpu_sampler()
    draw = sample_reference if path == "reference" else sample
    gen = torch.Generator().manual_seed(3)
    vocab, rows = 2000, 64
    row = torch.randn(vocab, generator=gen)
    best = row.topk(3).indices.tolist()
    logits = row.expand(rows, vocab).contiguous()
    uniforms = (torch.arange(rows, dtype=torch.float32) + 0.5) / rows
    for temperature in (1e9, 1e30):
        ids = draw(logits, SamplingTensors.from_lists([temperature] * rows, [3] * rows, [1.0] * rows, [0.0] * rows),
                   uniforms)
        assert set(ids.tolist()) == set(best), (temperature, ids.unique().tolist(), best)  # uniform over the best 3
        ids = draw(logits, SamplingTensors.from_lists([temperature] * rows, [0] * rows, [1e-6] * rows, [0.0] * rows),
                   uniforms)
        assert set(ids.tolist()) == {best[0]}, temperature


def test_cpu_sampler_rows_are_independent_and_greedy_rows_take_the_argmax():
    _cpu_sampler()
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 49152, generator=gen) * 3
    logits[4, 7] = float("nan")
    tensors = SamplingTensors.from_lists([0.8, 0.0, 1.0, 0.6, 0.0, 1.2], [0, 0, 20, 0, 0, 0], [0.9, 1.0, 1.0, 1.0, 1.0, 0.5],
                                         [0.0, 0.0, 0.0, 0.05, 0.0, 0.0])
    uniforms = torch.rand(6, generator=gen)
    together = sample(logits, tensors, uniforms)
    assert together[1] == logits[1].argmax() and together[4] == 7  # torch.argmax's rule: the first NaN
    for r in range(6):
        alone = SamplingTensors.from_lists([float(tensors.temperatures[r])], [int(tensors.top_ks[r])],
                                           [float(tensors.top_ps[r])], [float(tensors.min_ps[r])])
        assert sample(logits[r:r + 1], alone, uniforms[r:r + 1]).item() == together[r].item()


@pytest.mark.filterwarnings("ignore:The bitmask covers only")  # xgrammar's note on the unmasked tail: on purpose here
def test_the_lists_sampler_reads_the_grammar_mask_as_xgrammar_writes_it():
    """``sample_lists`` (parameters as host lists, the mask read as it goes) against xgrammar's mask written into
    the logits and then ``sample``: the same token on every row, the same uniforms; unflagged rows and columns
    past the mask's width unmasked; greedy rows take the masked argmax; the logits are left alone."""
    import xgrammar as xgr
    from specjet.kernels.sampling import cpu_sampler_serves, sample_lists

    if not cpu_sampler_serves(torch.zeros(1, 1)):
        pytest.skip("the C++ extension is not built")
    gen = torch.Generator().manual_seed(17)
    rows, vocab, width = 48, 1000, 30  # 30 words cover 960 columns: the last 40 columns stay unmasked
    logits = torch.randn(rows, vocab, generator=gen) * 2
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, width), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[::5] = 0  # rows whose mask allows none of the covered columns
    bitmask[1::7] = -1  # rows whose mask allows every covered column
    flags = [i % 4 != 3 for i in range(rows)]
    params = [(0.0 if i % 6 == 0 else 0.5 + (i % 5) * 0.2, [-1, 5, 40][i % 3], [1.0, 0.9, 0.6][i % 3 - 1],
               [0.0, 0.05][i % 2]) for i in range(rows)]
    uniforms = torch.rand(rows, generator=gen)
    before = logits.clone()
    drawn = sample_lists(logits, *(list(column) for column in zip(*params)), uniforms.tolist(), (bitmask, flags))
    assert torch.equal(logits, before)
    written = logits.clone()
    xgr.apply_token_bitmask_inplace(written, bitmask, indices=[i for i, f in enumerate(flags) if f], backend="cpu")
    expected = sample(written, SamplingTensors.from_lists(*(list(column) for column in zip(*params))), uniforms)
    assert drawn == expected.tolist()
    assert all(not f or d >= 32 * width or (int(bitmask[i, d // 32]) >> (d % 32)) & 1
               for i, (d, f) in enumerate(zip(drawn, flags)))
    assert any(d >= 32 * width for d, f in zip(drawn, flags) if f)  # the unmasked tail was drawn from


@pytest.mark.parametrize("allowed", [1, 2, 63, 64, 65, 300, 2048, 2049])
def test_a_sparse_masked_row_draws_what_its_masked_copy_draws(allowed):
    """A masked row allowing at most 2,048 tokens is drawn from its allowed columns alone (csrc/sampling.cpp's
    sparse path): the same token as the row with xgrammar's -inf written in (the C++ dense path, which the tests
    above hold to the torch reference) for every filter and coin, allowed columns clustered in blocks or scattered, in the last partial block of
    64 columns too, a NaN or +inf among them (left to the dense path), -inf logits among them."""
    import xgrammar as xgr
    from specjet.kernels.sampling import cpu_sampler_serves, sample_lists

    if not cpu_sampler_serves(torch.zeros(1, 1)):
        pytest.skip("the C++ extension is not built")
    gen = torch.Generator().manual_seed(allowed)
    rows, vocab = 40, 5000  # 78 whole blocks of 64 columns and one of 8
    width = (vocab + 31) // 32
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::4] = logits[::4].round(decimals=0)  # ties between columns
    allow = torch.zeros(rows, 32 * width, dtype=torch.bool)
    for r in range(rows):
        if r % 3 == 0:  # clustered: a run of columns
            start = int(torch.randint(0, vocab - allowed + 1, (), generator=gen))
            allow[r, start:start + allowed] = True
        else:
            allow[r, torch.randperm(vocab, generator=gen)[:allowed]] = True
    allow[5, :vocab] = False
    allow[5, vocab - min(allowed, 8):vocab] = True  # the last, partial block
    cols = [allow[r].nonzero()[:, 0] for r in range(rows)]
    logits[7, cols[7][0]] = float("nan")
    logits[9, cols[9][-1]] = float("inf")
    logits[11, cols[11][:allowed // 2]] = float("-inf")  # never all of them: a row allowing nothing is not drawn
    bits = allow.view(rows, width, 32).to(torch.int64) << torch.arange(32)
    bitmask = bits.sum(-1).to(torch.int64)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    flags = [True] * rows
    params = [(0.3 + (i % 5) * 0.3, [-1, 3, 50][i % 3], [1.0, 0.9, 0.5][i % 3 - 1], [0.0, 0.02, 0.3][i % 3 - 2])
              for i in range(rows)]
    written = logits.clone()
    xgr.apply_token_bitmask_inplace(written, bitmask, backend="cpu")
    for trial in range(5):
        uniforms = torch.rand(rows, generator=gen)
        uniforms[0] = 0.0
        uniforms[1] = 1.0 - 2**-24
        drawn = sample_lists(logits, *(list(column) for column in zip(*params)), uniforms.tolist(), (bitmask, flags))
        dense = sample_lists(written, *(list(column) for column in zip(*params)), uniforms.tolist())
        assert drawn == dense, trial
        assert all(allow[r, d] for r, d in enumerate(drawn)), "a forbidden token was drawn"


def test_the_lists_sampler_refuses_bad_inputs():
    ext = _cpu_sampler()
    logits = torch.randn(2, 40)
    good = dict(temperatures=[0.7, 1.0], top_ks=[-1, 5], top_ps=[0.9, 1.0], min_ps=[0.0, 0.1], uniforms=[0.2, 0.8])

    def call(bitmask=None, masked=(), **changes):
        args = dict(good, **changes)
        return ext.sample_rows_lists(logits, args["temperatures"], args["top_ks"], args["top_ps"], args["min_ps"],
                                     args["uniforms"], bitmask, list(masked))

    assert len(call()) == 2
    with pytest.raises(RuntimeError, match="one parameter a row"):
        call(uniforms=[0.2])
    with pytest.raises(RuntimeError, match="bitmask must be a CPU int32"):
        call(torch.zeros(2, 2, dtype=torch.int64), [True, False])
    with pytest.raises(RuntimeError, match="bitmask must be a CPU int32"):
        call(torch.zeros(3, 2, dtype=torch.int32), [True, False, True])
    with pytest.raises(RuntimeError, match="one masked flag a row"):
        call(torch.zeros(2, 2, dtype=torch.int32), [True])
    with pytest.raises(RuntimeError, match="logits must be a CPU float32"):
        ext.sample_rows_lists(logits.double(), *good.values(), None, [])


def test_top_p_zero_keeps_the_best_token_in_the_reference_and_the_cpu_op():
    """top_p = 0 (refused at the engine's door, reachable by direct callers) keeps only the first token in the
    order, as both paths document: the torch reference dropped every token (0/0, then token V-1 every row)."""
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    uniforms = torch.tensor([0.3, 0.6, 0.99])
    st = SamplingTensors.from_lists([1.0] * 3, [0] * 3, [0.0] * 3, [0.0] * 3)
    assert sample_reference(x, st, uniforms).tolist() == x.argmax(-1).tolist()
    if cpu_ops.extension() is not None:
        assert sample_lists(x, [1.0] * 3, [0] * 3, [0.0] * 3, [0.0] * 3, uniforms.tolist()) == x.argmax(-1).tolist()


@pytest.mark.parametrize("path", ["reference", "cpu"])
def test_the_filters_edges_exact_ties_a_top_k_of_one_and_a_coin_of_zero(path):
    """The filters at their boundaries, where the rules' ``<`` and ``>=`` decide: four equal tokens (each exactly 1/4)
    under top-p 0.5 keep two (a token is dropped once the mass before it reaches p: the third's is exactly 0.5); a
    min-p of 1.0 keeps the best token (one whose probability is min_p times the best's is kept, not dropped: dropping
    it left no token at all); a top-k of 1 with a temperature keeps the best token alone; and a coin of exactly 0
    draws the first token of positive mass, never a zero-mass (masked or filtered) token before it."""
    if path == "cpu":
        _cpu_sampler()
    draw = sample_reference if path == "reference" else sample
    grid = 64
    uniforms = (torch.arange(grid, dtype=torch.float32) + 0.5) / grid

    def drawn(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, coins=uniforms):
        rows = logits.expand(len(coins), -1).contiguous()
        tensors = SamplingTensors.from_lists([temperature] * len(coins), [top_k] * len(coins), [top_p] * len(coins),
                                             [min_p] * len(coins))
        return set(draw(rows, tensors, coins).tolist())

    flat = torch.zeros(1, 4)
    assert len(drawn(flat, top_p=0.5)) == 2
    assert len(drawn(flat, top_p=0.5 + 1e-3)) == 3
    peaked = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    assert drawn(peaked, min_p=1.0) == {1}
    assert drawn(peaked, top_k=1, temperature=1.5) == {1}
    masked = torch.tensor([[float("-inf"), float("-inf"), 0.5, 0.0, 1.0]])
    assert drawn(masked, coins=torch.zeros(3)) == {2}
    if path == "reference":  # the distributions themselves
        probs = filtered_probs(flat, st(1, top_p=0.5))[0]
        assert sorted(probs.tolist()) == [0.0, 0.0, 0.5, 0.5]
        assert filtered_probs(peaked, st(1, min_p=1.0))[0].tolist() == [0.0, 1.0, 0.0, 0.0]
        assert filtered_probs(peaked, st(1, 1.5, top_k=1))[0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_a_greedy_row_of_a_sampled_batch_gets_a_one_hot_distribution():
    """``filtered_probs``' rule for a temperature-0 row beside sampled ones (the verifier's torch path builds every
    node's distribution with it): a one-hot at the argmax, not softmax(logits / 0)."""
    logits = torch.tensor([[0.5, 3.0, 1.0], [0.5, 3.0, 1.0]])
    probs = filtered_probs(logits, SamplingTensors.from_lists([0.0, 1.0], [-1, -1], [1.0, 1.0], [0.0, 0.0]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))
