"""Every path that splits a row over programs, against torch in fp64, forward and backward:
cross_entropy's parts (chapter 09: the gradient to a buffer, in place as chapter 10 writes it,
the loss alone), linear_cross_entropy's in-place chunks (chapter 10), softmax's split forward
and backward (chapter 02) and layer norm's (chapter 13), at the smallest sizes that split.

The interpreter runs a grid's programs one after another: a program that waits for its
siblings finds those after it not yet run and takes its way out, and those before it have
already written their results. Each check runs in the interpreter's order, reversed and
shuffled, so that no program depends on which siblings ran before it (issue 46: a way out read
a row that earlier siblings had overwritten in place with their gradient)."""

import importlib
import random

from conftest import random_tensor
import pytest
from stepkernels import cross_entropy, layer_norm, linear_cross_entropy
from stepkernels.lessons import check_cross_entropy
from stepkernels.ops.layer_norm import backward_config, forward_config
from stepkernels.runtime.core import DEVICE, INTERPRET
import torch
import torch.nn.functional as F
import triton
from triton.runtime import interpreter

ce = importlib.import_module("stepkernels.ops.cross_entropy")
lce = importlib.import_module("stepkernels.ops.linear_cross_entropy")
sm = importlib.import_module("stepkernels.ops.softmax")

DTYPES = (torch.float32, torch.float16)
TOLERANCE = check_cross_entropy.TOLERANCE  # one rounding of the dtype


@pytest.fixture(params=["as launched", "reversed", "shuffled"])
def program_order(request, monkeypatch):
    """Run every grid's programs in this order (the interpreter; a GPU keeps its own)."""
    if request.param == "as launched":
        return
    if not INTERPRET:
        pytest.skip("a GPU runs programs in an order of its own")
    set_grid_idx, orders = interpreter.InterpreterBuilder.set_grid_idx, {}

    def permuted(builder, x, y, z):
        nx, ny, nz = builder.grid_dim
        if builder.grid_dim not in orders:  # one order a grid shape, the same every run
            order = list(range(nx * ny * nz))[::-1]
            if request.param == "shuffled":
                random.Random(len(order)).shuffle(order)
            orders[builder.grid_dim] = order
        index = orders[builder.grid_dim][(x * ny + y) * nz + z]
        set_grid_idx(builder, index // (ny * nz), index // nz % ny, index % nz)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "set_grid_idx", permuted)


def assert_close(got, want, dtype, scale=None):
    """Within one rounding of ``dtype`` of the fp64 ``want``, relative to ``scale`` (default:
    its largest value) for the values near zero."""
    tol = TOLERANCE[dtype]
    scale = want.abs().nan_to_num(0.0).max().item() if scale is None else scale
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale, equal_nan=True)


# Cross-entropy: 300 values a row in parts of 128, the loss per row and its gradient times a
# scale per row, label smoothing, an ignored row and targets in each of the three parts.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1], ids=["on the grid", "off the grid"])
@pytest.mark.parametrize("gradient", ["to a buffer", "in place", "none"])
def test_cross_entropy_parts(gradient, offset, dtype, program_order):
    n_rows, n_cols, launch = 5, 300, ce.Launch(part=128, num_warps=4)
    assert triton.cdiv(n_cols, launch.part) == 3
    memory = random_tensor((n_rows * n_cols + 8,), dtype, seed=offset, scale=3.0)
    logits = memory[offset : offset + n_rows * n_cols].view(n_rows, n_cols)
    assert ce.rows_aligned(logits, 1) == (offset == 0)  # 1 value a group: the interpreter's
    target = torch.tensor([5, 150, 299, -100, 200], device=DEVICE)
    options = ce.check_target(target, logits.shape, -100, 0.1, "none")
    scale = torch.linspace(0.5, 1.5, n_rows, device=DEVICE)
    exact = logits.double().requires_grad_()
    want = F.cross_entropy(exact, target, ignore_index=-100, label_smoothing=0.1, reduction="none")
    (want_grad,) = torch.autograd.grad(want, exact, scale.double())
    before = memory.clone()
    grad = {"to a buffer": ce.empty_rows_like(logits), "in place": logits, "none": None}[gradient]
    losses = ce.loss_rows(logits, target, options, grad, scale if grad is not None else None, launch)
    assert_close(losses, want.detach(), torch.float32)
    if grad is not None:
        assert_close(grad, want_grad, dtype)
    untouched = torch.ones_like(memory, dtype=torch.bool)  # the neighbours, and the logits
    untouched[offset : offset + n_rows * n_cols] = gradient != "in place"
    assert torch.equal(memory[untouched], before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_default_parts(dtype, program_order):
    """The smallest vocabulary the launch rule splits with the gradient (and the loss alone)."""
    n_cols, size = 32_769, torch.finfo(dtype).bits // 8
    assert ce.default_launch(n_cols, size, True, True).part < n_cols
    assert ce.default_launch(n_cols, size, False, True).part < n_cols
    logits = random_tensor((3, n_cols), dtype, seed=2, scale=3.0)
    target = check_cross_entropy.targets(3, n_cols, DEVICE, seed=2, ignored_every=0)
    check_cross_entropy.check(cross_entropy, logits, target, label_smoothing=0.1)
    want = F.cross_entropy(logits.double(), target, reduction="none")
    assert_close(cross_entropy(logits, target, reduction="none"), want, dtype)  # loss alone


# V = 33,000 is slow under the interpreter: the order users get; test_cross_entropy_parts covers
# the other orders on small parts.
@pytest.mark.parametrize("program_order", ["as launched"], indirect=True)
# "mean" writes the gradient in the forward, "none" again in the backward; each in one dtype,
# as each takes a minute under the interpreter (the loss_rows tests above cover both dtypes)
@pytest.mark.parametrize("reduction, dtype", [("mean", torch.float32), ("none", torch.float16)])
def test_linear_cross_entropy_in_place_chunks(reduction, dtype, program_order, monkeypatch):
    """V = 33,000: each row of a chunk's logits in parts (8,192 fp32, 16,384 fp16 values), the
    gradient written over them in place: the case issue 46 found wrong. The weight is frozen:
    dW's product over V rows takes a minute under the interpreter, and dX and dB are made
    from the same gradient."""
    # Two chunks of two rows and one; "none" makes two passes (the loss, then the gradient in
    # the backward): one chunk there keeps it quick
    n_rows, hidden, n_cols, chunk_tokens = 3, 16, 33_000, 2 if reduction == "mean" else None
    assert ce.default_launch(n_cols, torch.finfo(dtype).bits // 8, True, True).part < n_cols
    in_place = []

    def loss_rows(logits, target, options, grad=None, scale=None, launch=None):
        in_place.append(grad is logits)
        return ce.loss_rows(logits, target, options, grad, scale, launch)

    monkeypatch.setattr(lce, "loss_rows", loss_rows)
    shapes = [(n_rows, hidden), (n_cols, hidden), (n_cols,)]  # x, weight, bias
    tensors = [random_tensor(shape, dtype, seed) for seed, shape in enumerate(shapes)]
    ours = [t.clone().requires_grad_(i != 1) for i, t in enumerate(tensors)]  # weight frozen
    exact = [t.double().requires_grad_() for t in tensors]
    target = torch.tensor([7, 20_000, -100], device=DEVICE)
    options = dict(label_smoothing=0.1, reduction=reduction)
    loss = linear_cross_entropy(ours[0], ours[1], target, ours[2], chunk_tokens=chunk_tokens, **options)
    want = F.cross_entropy(F.linear(*exact), target, **options)
    grad_loss = torch.linspace(0.5, 1.5, want.numel(), device=DEVICE, dtype=torch.float64).view(want.shape)
    grads = torch.autograd.grad(loss, ours[::2], grad_loss.to(dtype))
    want_grads = torch.autograd.grad(want, exact[::2], grad_loss)
    assert in_place == ([True, True] if reduction == "mean" else [False, True])  # over the logits
    # fp16: the logits and their gradient each rounded once, then a product over V
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(loss.double(), want.detach(), rtol=tol, atol=tol)
    for name, got, wanted in zip(("dx", "db"), grads, want_grads, strict=True):
        scale = wanted.abs().max().item()
        torch.testing.assert_close(got.double(), wanted, rtol=tol, atol=tol * scale, msg=lambda m, n=name: f"{n}: {m}")


# Softmax: 300 values a row in chunks of 128; a whole chunk of -inf in one row.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_softmax_split_forward_and_backward(log, dtype, program_order):
    launch = sm.Launch("split", block_n=128)
    assert sm.default_launch(32_769).kernel == sm.default_launch(16_385, backward=True).kernel == "split"
    x = random_tensor((4, 300), dtype, seed=3, scale=4.0)
    x[1, 128:256] = -float("inf")
    dy = random_tensor((4, 300), dtype, seed=4)
    y = sm.softmax_forward(x, log, launch)
    dx = sm.softmax_backward(y, dy, log, launch)
    exact = x.double().requires_grad_()
    want = (torch.log_softmax if log else torch.softmax)(exact, dim=-1)
    (want_dx,) = torch.autograd.grad(want, exact, dy.double())
    finite = want.isfinite()  # log_softmax's -inf: where the input's is
    assert torch.equal(y.isfinite(), finite)
    assert_close(y[finite], want.detach()[finite], dtype)
    assert_close(dx, want_dx, dtype)


# Layer norm: rows in chunks of block_size, forward and backward (dx, dW, dB). 9 x 300 in
# chunks of 128: a group of rows in one batch; 33 x 2,100 in chunks of 1,024: groups of 16 rows
# in batches of 4 (fp32) or 8 (fp16), the last group of one row.
@pytest.mark.parametrize("reduction", ["two-stage", "lock"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, block_size", [((9, 300), 128), ((33, 2100), 1024)])
def test_layer_norm_split_forward_and_backward(shape, block_size, dtype, reduction, program_order):
    (n_rows, n_cols), size = shape, torch.finfo(dtype).bits // 8
    assert forward_config(n_cols, n_rows, block_size, size)["BLOCK_N"] < n_cols
    config = backward_config(n_cols, n_rows, block_size, None, size)
    assert config["BLOCK_N"] < n_cols
    if INTERPRET:  # the interpreter's groups: 4 a launch
        assert (config["BATCH"] < config["ROWS_PER_PROGRAM"] < n_rows) == (block_size == 1024)
    x = random_tensor(shape, dtype, seed=5, scale=2.0, shift=0.5)
    params = [random_tensor((n_cols,), dtype, seed) for seed in (6, 7)]
    dy = random_tensor(shape, dtype, seed=8)
    ours = [t.clone().requires_grad_() for t in (x, *params)]
    exact = [t.double().requires_grad_() for t in (x, *params)]
    y = layer_norm(ours[0], n_cols, *ours[1:], reduction=reduction, block_size=block_size)
    want = F.layer_norm(exact[0], (n_cols,), *exact[1:])
    assert_close(y, want.detach(), dtype)
    grads = torch.autograd.grad(y, ours, dy)
    want_grads = torch.autograd.grad(want, exact, dy.double())
    # dx is a difference of terms of size rstd * |w dy|
    rstd = (exact[0].detach().var(1, unbiased=False) + 1e-5).rsqrt().max().item()
    dx_scale = rstd * (dy.double() * exact[1].detach()).abs().max().item()
    for got, wanted, scale in zip(grads, want_grads, (dx_scale, None, None), strict=True):
        assert_close(got, wanted, dtype, scale)
