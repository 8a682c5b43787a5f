"""train/head_loss.py: the chunked head cross-entropy against the unfused loss written out here."""
import pytest
import torch
import torch.nn.functional as F

from specjet.kernels import cpu_ops
from specjet.kernels.cpu_features import has_native_bf16
from specjet.train import head_loss
from specjet.train.head_loss import head_cross_entropy


def problem(n: int, h: int = 48, columns: int = 300, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    weight_t = torch.randn(h, columns, generator=gen) * 0.3
    targets = torch.randint(0, columns, (n,), generator=gen)
    weights = torch.rand(n, generator=gen)
    weights[1::5] = 0.0  # rows that do not count (the trainer's padding)
    return hidden, weight_t, targets, weights


def unfused(hidden, weight_t, targets, weights):
    logits = (hidden @ weight_t).float()
    loss = (F.cross_entropy(logits, targets, reduction="none") * weights).sum() / weights.sum()
    return loss, logits.detach()


def assert_best(predicted, logits, atol):
    """Each predicted column holds its row's maximum logit (up to the products' rounding: a chunk's matmul may
    block its sums otherwise than the whole one's, so a near-tie may resolve either way on some CPU)."""
    best = logits.max(-1).values
    assert bool((logits.gather(1, predicted[:, None])[:, 0] >= best - atol).all())


@pytest.mark.parametrize("n", [1, 63, 64, 200])  # one chunk, a partial one, several
def test_loss_argmax_and_gradient_equal_the_unfused_loss(n, monkeypatch):
    monkeypatch.setattr(head_loss, "CHUNK_ROWS", 64)
    hidden, weight_t, targets, weights = problem(n)
    loss, predicted = head_cross_entropy(hidden, weight_t, targets, weights)
    (grad,) = torch.autograd.grad(3.0 * loss, hidden)  # a scale on the loss reaches the gradient
    ref_loss, ref_logits = unfused(hidden, weight_t, targets, weights)
    (ref_grad,) = torch.autograd.grad(3.0 * ref_loss, hidden)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_best(predicted, ref_logits, 1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert bool((grad[weights == 0] == 0).all())  # a weightless row gets no gradient


@pytest.mark.parametrize("fused", [True, False])  # the C++ rows where built, and torch's chunks
@pytest.mark.parametrize("distill", [0.5, 1.0])
@pytest.mark.parametrize("n", [63, 200])
def test_a_distilled_label_is_the_mixture_of_the_one_hot_and_the_teachers_distribution(n, distill, fused, monkeypatch):
    """With teacher rows the label is (1 - distill) one-hot + distill softmax(teacher @ weight_t): loss and
    gradient equal that cross-entropy written out, and the argmax stays the student's."""
    monkeypatch.setattr(head_loss, "CHUNK_ROWS", 64)
    if not fused:
        monkeypatch.setattr(head_loss, "_fused_rows", lambda rows: False)
    hidden, weight_t, targets, weights = problem(n, seed=2)
    teacher = torch.randn(n, hidden.shape[1], generator=torch.Generator().manual_seed(9))
    loss, predicted = head_cross_entropy(hidden, weight_t, targets, weights, teacher, distill)
    (grad,) = torch.autograd.grad(2.0 * loss, hidden)
    log_probs = (hidden @ weight_t).float().log_softmax(-1)
    label = (1.0 - distill) * F.one_hot(targets, weight_t.shape[1]) + distill * (teacher @ weight_t).softmax(-1)
    ref_loss = (-(label * log_probs).sum(-1) * weights).sum() / weights.sum()
    (ref_grad,) = torch.autograd.grad(2.0 * ref_loss, hidden)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_best(predicted, log_probs.detach(), 1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(loss, head_cross_entropy(hidden, weight_t, targets, weights)[0])  # the teacher counts
    assert bool((grad[weights == 0] == 0).all())


def test_a_distill_weight_of_zero_is_the_one_hot_loss():
    hidden, weight_t, targets, weights = problem(40, seed=3)
    teacher = torch.randn(40, hidden.shape[1])
    assert torch.equal(head_cross_entropy(hidden, weight_t, targets, weights, teacher, 0.0)[0],
                       head_cross_entropy(hidden, weight_t, targets, weights)[0])
    with pytest.raises(ValueError, match="distill"):
        head_cross_entropy(hidden, weight_t, targets, weights, teacher, 1.5)
    with pytest.raises(ValueError, match="teacher rows"):
        head_cross_entropy(hidden, weight_t, targets, weights, teacher[:5], 0.5)
    with pytest.raises(ValueError, match="needs the teacher rows"):
        head_cross_entropy(hidden, weight_t, targets, weights, None, 0.5)


@pytest.mark.skipif(not has_native_bf16(), reason="bf16 autocast is emulated (slow) without native bf16")
def test_under_bf16_autocast_the_product_runs_in_bf16_as_the_unfused_path():
    hidden, weight_t, targets, weights = problem(130, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, predicted = head_cross_entropy(hidden, weight_t, targets, weights)
        ref_loss, ref_logits = unfused(hidden, weight_t, targets, weights)
    assert loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss, hidden)
    (ref_grad,) = torch.autograd.grad(ref_loss, hidden)
    assert grad.dtype == hidden.dtype
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)  # the same bf16 logits, summed in fp32
    assert_best(predicted, ref_logits, 0.05)  # bf16 logits
    torch.testing.assert_close(grad, ref_grad, rtol=2e-2, atol=2e-3 * float(ref_grad.abs().max()))


def test_refuses_a_trainable_head_and_mismatched_shapes():
    hidden, weight_t, targets, weights = problem(8)
    with pytest.raises(ValueError, match="frozen"):
        head_cross_entropy(hidden, weight_t.clone().requires_grad_(), targets, weights)
    with pytest.raises(ValueError, match=r"targets \[n\]"):
        head_cross_entropy(hidden, weight_t, targets[:5], weights)


requires_fused = pytest.mark.skipif(
    cpu_ops.extension() is None or not hasattr(cpu_ops.extension(), "head_cross_entropy_rows"),
    reason="the C++ extension is not built")


def chunk_problem(rows: int, columns: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, columns, generator=gen) * 4.0).to(dtype)
    logits[0] += 1000.0  # a shift far past exp's range: the row's maximum is taken out first
    if rows > 2:
        logits[2, 7] = logits[2, 3] = logits[2].max() + 1.0  # a tie: the first maximal column
    targets = torch.randint(0, columns, (rows,), generator=gen)
    targets[1] = int(logits[1].float().argmax())  # a target at the row's own argmax
    share = torch.rand(rows, generator=gen) / rows
    return logits, targets, share


@requires_fused
@pytest.mark.parametrize("columns", [300, 1024, 8192 + 5])  # a tail past the 16 x 64 sums, whole blocks, both
@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("distill", [None, 0.6])  # one-hot labels, and labels mixed with a teacher's softmax
def test_the_fused_rows_give_the_torch_chunks_loss_argmax_and_gradient(columns, logit_dtype, grad_dtype, distill):
    logits, targets, share = chunk_problem(9, columns, logit_dtype)
    teacher = None if distill is None else chunk_problem(9, columns, logit_dtype, seed=1)[0]
    grad = torch.empty(9, columns, dtype=grad_dtype)
    ref_grad = torch.empty(9, columns, dtype=grad_dtype)
    ce, predicted = head_loss.chunk_cross_entropy(logits, targets, share, grad, teacher, distill or 0.0)
    ref_ce, ref_predicted = head_loss.chunk_cross_entropy_reference(logits.clone(), targets, share, ref_grad, teacher,
                                                                    distill or 0.0)
    assert predicted.tolist() == ref_predicted.tolist()  # the same float values, the same first-maximum rule
    assert int(predicted[2]) == 3
    torch.testing.assert_close(ce, ref_ce, rtol=1e-5, atol=1e-5)
    # float32: the exponentials' rounding, and in row 0 that of x - max against x - lse at 1,000's float step
    # (6e-5); bf16: at most one step of the stored value's rounding apart.
    rtol, atol = (1e-4, 1e-9) if grad_dtype == torch.float32 else (2 ** -7, 1e-12)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=rtol, atol=atol)
    # softmax - label sums to zero over a row: each row's gradient sums to ~0 times its share (up to the
    # rounding of its largest entry, the target's)
    assert float(grad.float().sum(-1).abs().max()) < rtol * float(share.max())
    if teacher is None:
        assert bool((grad.float()[torch.arange(9), targets] <= 0).all())
    else:  # the teacher counts: not the one-hot gradient
        one_hot = torch.empty_like(grad)
        head_loss.chunk_cross_entropy(logits, targets, share, one_hot)
        assert float((grad.float() - one_hot.float()).abs().max()) > 10 * rtol * float(share.max())


@requires_fused
def test_the_fused_rows_refuse_what_their_tensors_cannot_hold():
    logits, targets, share = chunk_problem(4, 64, torch.float32)
    grad = torch.empty(4, 64)
    bad_targets = targets.clone()
    bad_targets[3] = 64
    with pytest.raises(RuntimeError, match="target 64 of row 3 outside the 64 columns"):
        head_loss.chunk_cross_entropy(logits, bad_targets, share, grad)
    with pytest.raises(RuntimeError, match="grad must be"):
        head_loss.chunk_cross_entropy(logits, targets, share, torch.empty(4, 63))
    with pytest.raises(RuntimeError, match="logits must be"):
        head_loss.chunk_cross_entropy(logits.double(), targets, share, grad)
    with pytest.raises(RuntimeError, match="share must be"):
        head_loss.chunk_cross_entropy(logits, targets, share[:3], grad)
    with pytest.raises(RuntimeError, match="teacher must be"):
        head_loss.chunk_cross_entropy(logits, targets, share, grad, logits[:, :32], 0.5)
    with pytest.raises(RuntimeError, match="distill must lie"):
        head_loss.chunk_cross_entropy(logits, targets, share, grad, logits, 1.5)


def test_the_torch_chunks_serve_where_the_extension_is_missing(monkeypatch):
    """Without the C++ op the loss takes the torch chunks, and agrees with the unfused loss all the same."""
    monkeypatch.setattr(head_loss, "_fused_rows", lambda rows: False)
    hidden, weight_t, targets, weights = problem(70, seed=2)
    loss, predicted = head_cross_entropy(hidden, weight_t, targets, weights)
    ref_loss, ref_logits = unfused(hidden, weight_t, targets, weights)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_best(predicted, ref_logits, 1e-5)
