"""stepkernels.cross_entropy and linear_cross_entropy against torch in fp64, through the
public functions only."""

from conftest import random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
from stepkernels import cross_entropy, linear_cross_entropy
from stepkernels.lessons import check_cross_entropy
from stepkernels.runtime.core import DEVICE, ON_GPU
import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
RTOL = check_cross_entropy.TOLERANCE
REDUCTIONS = ("mean", "sum", "none")


def targets(n_rows, n_cols, seed=0, ignored_every=3, ignore_index=-100):
    return check_cross_entropy.targets(n_rows, n_cols, DEVICE, seed, ignored_every, ignore_index)


def check(logits, target, grad_scale=0.7, **options):
    return check_cross_entropy.check(cross_entropy, logits, target, grad_scale, **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (5, 3), (9, 100), (4, 4096), (3, 4097), (2, 50_257)])
def test_matches_torch(shape, reduction, dtype):
    logits = random_tensor(shape, dtype, scale=3.0)
    check(logits, targets(*shape), reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_label_smoothing_with_ignored_rows(dtype, reduction):
    # Liger-Kernel once got this pair wrong (its PR #198): smoothing must skip ignored rows.
    logits = random_tensor((12, 9001), dtype, seed=2, scale=2.0)
    check(logits, targets(12, 9001, seed=3), label_smoothing=0.1, reduction=reduction)


@pytest.mark.parametrize("ignore_index", [-1, 0, 4])
def test_any_ignore_index(ignore_index):
    logits = random_tensor((10, 5), seed=4)
    check(logits, targets(10, 5, seed=5, ignore_index=ignore_index), ignore_index=ignore_index)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_target_ignored_gives_what_torch_gives(reduction):
    logits = random_tensor((4, 6000), seed=6)
    target = torch.full((4,), -100, device=DEVICE)
    loss, grad = check(logits, target, reduction=reduction, label_smoothing=0.2)
    assert torch.isnan(loss).all() if reduction == "mean" else (loss == 0).all()
    assert (grad == 0).all()


def test_strided_logits_and_int32_targets():
    wide = random_tensor((6, 8200), scale=2.0)
    logits = wide[:, 3:8003]  # rows 8,200 apart, read in place
    check(logits, targets(6, 8000).int(), label_smoothing=0.05)
    check(wide.t()[:5].t(), targets(6, 5, seed=8))  # column-major: copied first


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [5, 9001, 50_257])
def test_forward_alone_matches_torch(n_cols, dtype):
    # Without a gradient the row's parts do not wait: the last to arrive writes the loss.
    logits = random_tensor((5, n_cols), dtype, seed=9, scale=4.0)
    target = targets(5, n_cols, seed=10)
    for options in ({"reduction": "none"}, {"label_smoothing": 0.2}):
        want = F.cross_entropy(logits.double(), target, **options)
        rtol = RTOL[dtype]
        torch.testing.assert_close(cross_entropy(logits, target, **options).double(), want, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 3, 6])
def test_rows_off_the_16_byte_grid(offset, dtype):
    # Rows that start anywhere in a 16-byte group (an odd V, a slice at an odd offset): on a
    # GPU read and written in whole groups, the neighbours' values in the shared ones kept.
    n_cols = 40_009 if ON_GPU else 2_003
    buffer = random_tensor((4 * n_cols + 16,), dtype, seed=offset, scale=3.0)
    logits = buffer[offset : offset + 4 * n_cols].view(4, n_cols)
    check(logits, targets(4, n_cols, seed=offset), label_smoothing=0.1)
    check(logits, targets(4, n_cols, seed=offset), reduction="none")


def test_large_logits_stay_finite():
    logits = random_tensor((3, 10_000), scale=1e4)
    logits[0, 17] = 3e38  # near fp32's largest
    check(logits, targets(3, 10_000, ignored_every=0))


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel traps: tests/test_errors.py runs it in a child")
def test_out_of_range_target_is_refused_never_a_nan_loss():
    """They gave their rows NaN (issue 46); now a ValueError naming the first, as PyTorch's
    loss raises on the CPU, for every reduction and with the gradient."""
    logits = random_tensor((4, 5000)).requires_grad_()
    target = torch.tensor([1, 5000, -100, -7], device=DEVICE)
    for reduction in REDUCTIONS:
        with pytest.raises(ValueError, match=r"target\[1\] is 5000, outside the classes \[0, 5000\)"):
            cross_entropy(logits, target, reduction=reduction)
    with pytest.raises(IndexError):  # PyTorch's on the CPU
        F.cross_entropy(logits, target)


def test_inputs_are_left_unchanged_and_no_rows_are_fine():
    logits = random_tensor((5, 9000), torch.bfloat16).requires_grad_()
    before = logits.detach().clone()
    loss = cross_entropy(logits, targets(5, 9000))
    loss.backward()
    assert torch.equal(logits.detach(), before)
    empty = torch.zeros(0, 7, device=DEVICE)
    assert cross_entropy(empty, torch.zeros(0, dtype=torch.long, device=DEVICE)).isnan()
    assert cross_entropy(empty, torch.zeros(0, dtype=torch.long, device=DEVICE), reduction="sum") == 0


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_under_autocast_is_fp32_as_torchs(reduction):
    """Autocast runs torch's losses in fp32; ours too, from bf16 logits (a bf16 loss before)."""
    logits = random_tensor((6, 50), torch.bfloat16, seed=2).requires_grad_()
    x, weight = random_tensor((6, 16), torch.bfloat16), random_tensor((50, 16), torch.bfloat16)
    target = torch.randint(0, 50, (6,), device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = cross_entropy(logits, target, reduction=reduction)
        want = F.cross_entropy(logits, target, reduction=reduction)
        fused = linear_cross_entropy(x, weight, target, reduction=reduction)
        unfused = F.cross_entropy(F.linear(x, weight), target, reduction=reduction)
    assert got.dtype == want.dtype == fused.dtype == unfused.dtype == torch.float32
    # torch's CUDA loss under autocast keeps a bf16 step inside (0.1% off): against fp32 instead
    exact = F.cross_entropy(logits.float(), target, reduction=reduction)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, unfused, rtol=2e-2, atol=2e-2)  # bf16 logits, rounded
    (grad,) = torch.autograd.grad(got.sum(), logits)
    assert grad.dtype == torch.bfloat16


def test_second_backward_recomputes_the_gradient():
    logits = random_tensor((3, 5000)).requires_grad_()
    loss = cross_entropy(logits, targets(3, 5000, ignored_every=0), label_smoothing=0.1)
    (first,) = torch.autograd.grad(loss, logits, retain_graph=True)
    first = first.clone()
    (second,) = torch.autograd.grad(loss, logits, torch.tensor(2.0, device=DEVICE))
    torch.testing.assert_close(second, 2 * first)


def test_gradient_accumulates_into_grad():
    logits = random_tensor((4, 300)).requires_grad_()
    target = targets(4, 300)
    cross_entropy(logits, target).backward()
    cross_entropy(logits, target).backward()
    (once,) = torch.autograd.grad(F.cross_entropy(logits.double(), target), logits)
    torch.testing.assert_close(logits.grad, 2 * once.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rows", ["expanded", "overlapping"])
def test_rows_sharing_memory_each_get_their_gradient(rows):
    def shared(leaf):  # rows of one row repeated, or rows 2 values apart
        return leaf[None, :6].expand(3, 6) if rows == "expanded" else leaf.as_strided((4, 6), (2, 1))

    base = random_tensor(16, scale=2.0)
    target = targets(len(shared(base)), 6, ignored_every=0)
    ours, theirs = (base.clone().requires_grad_() for _ in "ab")
    cross_entropy(shared(ours), target).backward()
    F.cross_entropy(shared(theirs).double(), target).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)


def test_refuses_bad_input_and_double_backward():
    logits, target = random_tensor((2, 5)), targets(2, 5, ignored_every=0)
    with pytest.raises(TypeError, match="class indices"):
        cross_entropy(logits, target.float())
    with pytest.raises(ValueError, match=r"reshape\(-1"):
        cross_entropy(logits[None], target[None])
    with pytest.raises(ValueError, match="one class per row"):
        cross_entropy(logits, target[:1])
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, target, reduction="avg")
    for bad in (1.5, None):  # torch refuses both; int() would truncate 1.5 to 1
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            cross_entropy(logits, target, ignore_index=bad)
    with pytest.raises(TypeError, match="label_smoothing must be a float"):
        cross_entropy(logits, target, label_smoothing="0.1")
    with pytest.raises(TypeError, match="positional"):  # torch's third is class weights
        cross_entropy(logits, target, torch.ones(5))
    with pytest.raises(TypeError, match="dtype"):
        cross_entropy(logits.double(), target)
    other = "cpu" if ON_GPU else "meta"
    with pytest.raises(ValueError, match="move it"):
        cross_entropy(logits.to(other), target)
    loss = cross_entropy(logits.requires_grad_(), target)
    (grad,) = torch.autograd.grad(loss, logits, create_graph=False, retain_graph=True)
    with pytest.raises(RuntimeError, match="differentiated twice"):
        torch.autograd.grad(loss, logits, create_graph=True)


@settings(max_examples=25, deadline=None)
@given(
    n_rows=st.integers(1, 6),
    n_cols=st.integers(1, 9000),
    smoothing=st.sampled_from([0.0, 0.3]),
    reduction=st.sampled_from(REDUCTIONS),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(n_rows, n_cols, smoothing, reduction, seed):
    logits = random_tensor((n_rows, n_cols), seed=seed, scale=5.0)
    check(logits, targets(n_rows, n_cols, seed=seed, ignored_every=2), label_smoothing=smoothing, reduction=reduction)


# ----------------------------------------------------------------------------- linear + loss
def linear_check(n_rows, hidden, n_cols, dtype, chunk_tokens, bias=True, **options):
    x, weight = (
        random_tensor((n_rows, hidden), dtype, 1, scale=0.5),
        random_tensor((n_cols, hidden), dtype, 2, scale=0.3),
    )
    tensors = [x, weight]
    tensors += [random_tensor((n_cols,), dtype, 3)] if bias else []
    ours = [t.clone().requires_grad_() for t in tensors]
    theirs = [t.double().requires_grad_() for t in tensors]
    target = targets(n_rows, n_cols, seed=4, ignored_every=4)
    loss = linear_cross_entropy(ours[0], ours[1], target, *ours[2:], chunk_tokens=chunk_tokens, **options)
    want = F.cross_entropy(F.linear(*theirs), target, **options)
    grad_loss = torch.full_like(want, 0.5)
    got = torch.autograd.grad(loss, ours, grad_loss.to(dtype))
    wanted = torch.autograd.grad(want, theirs, grad_loss)
    rtol = 1e-5 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(loss.double(), want, rtol=rtol, atol=rtol)
    for g, w in zip(got, wanted, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=rtol * w.abs().max().item())


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 7, None])
def test_linear_cross_entropy_matches_torch(chunk_tokens, dtype, reduction):
    linear_check(19, 32, 301, dtype, chunk_tokens, reduction=reduction, label_smoothing=0.1)


def test_linear_cross_entropy_long_odd_rows_in_place():
    # The loss writes its gradient over the chunk's logits: rows of several parts, off the
    # 16-byte grid on a GPU.
    linear_check(9, 16, 40_009 if ON_GPU else 9_001, torch.float32, 4, label_smoothing=0.1)


def test_linear_cross_entropy_without_bias_and_with_frozen_weight():
    linear_check(5, 16, 1000, torch.float32, 2, bias=False)
    x, weight = random_tensor((4, 16)).requires_grad_(), random_tensor((50, 16))
    loss = linear_cross_entropy(x, weight, targets(4, 50))
    (grad,) = torch.autograd.grad(loss, x)
    (want,) = torch.autograd.grad(F.cross_entropy(x @ weight.T, targets(4, 50)), x)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)


def test_linear_cross_entropy_second_backward_and_refusals():
    x, weight = random_tensor((6, 16)).requires_grad_(), random_tensor((40, 16)).requires_grad_()
    target = targets(6, 40)
    loss = linear_cross_entropy(x, weight, target, chunk_tokens=4)
    first = [g.clone() for g in torch.autograd.grad(loss, (x, weight), retain_graph=True)]
    second = torch.autograd.grad(loss, (x, weight), torch.tensor(3.0, device=DEVICE))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(b, 3 * a, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(x, weight.T, target)
    with pytest.raises(TypeError, match="dtype"):
        linear_cross_entropy(x, weight.half(), target)
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(x, weight, target, bias=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="chunk_tokens must be at least 1"):
        linear_cross_entropy(x, weight, target, chunk_tokens=0)
    with pytest.raises(TypeError, match="chunk_tokens must be an int"):
        linear_cross_entropy(x, weight, target, chunk_tokens=1.5)
    with pytest.raises(TypeError, match="class indices"):
        linear_cross_entropy(x, weight, target.float())


def test_int32_targets_with_an_ignore_index_past_int32_ignore_no_row():
    logits, target = random_tensor((6, 5), seed=7), targets(6, 5, seed=7, ignored_every=0)
    ignore = 2**32 + int(target[0])  # int32 would wrap it to a target that is there
    got = cross_entropy(logits, target.int(), ignore_index=ignore)
    want = F.cross_entropy(logits, target, ignore_index=ignore)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_gradient_of_transposed_x_scaled(reduction):
    """x laid out column by column: its gradient buffer must not copy that layout (the
    loss's scale was applied to a row layout, missing most of it)."""
    x = random_tensor((16, 6), seed=8).T.requires_grad_()
    weight, target = random_tensor((10, 16), seed=9), targets(6, 10, seed=9, ignored_every=0)
    (dx,) = torch.autograd.grad(3 * linear_cross_entropy(x, weight, target, reduction=reduction), x)
    exact = x.detach().double().requires_grad_()
    loss = 3 * F.cross_entropy(exact @ weight.double().T, target, reduction=reduction)
    (want,) = torch.autograd.grad(loss, exact)
    torch.testing.assert_close(dx.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_of_no_tokens_is_torchs(reduction):
    x = torch.zeros(0, 4, device=DEVICE, requires_grad=True)
    weight = random_tensor((5, 4), seed=10).requires_grad_()
    target = torch.zeros(0, dtype=torch.long, device=DEVICE)
    loss = linear_cross_entropy(x, weight, target, reduction=reduction)
    want = F.cross_entropy(x @ weight.T, target, reduction=reduction)
    torch.testing.assert_close(loss, want, equal_nan=True)
    if reduction != "none":
        dx, dw = torch.autograd.grad(loss, (x, weight))
        assert dx.shape == (0, 4) and torch.equal(dw, torch.zeros_like(weight))
