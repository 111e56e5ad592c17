"""layer_norm and LayerNorm against PyTorch, through the public API only."""

import math

from conftest import random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
import numpy as np
import pytest
from stepkernels import LayerNorm, layer_norm
from stepkernels.runtime.core import DEVICE, FLOAT_DTYPES, ON_GPU
import torch

REDUCTIONS = ("two-stage", "lock")
# One rounding of the dtype (two units for bf16: the interpreter truncates where a GPU rounds).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


def assert_close_to(actual, expected, dtype, what, scale=0.0):
    """``actual`` within one rounding of ``dtype`` of the fp64 ``expected``, relative to the
    tensor's largest value (or ``scale``, when its terms are larger than it)."""
    scale = max(scale, expected.abs().max().item() if expected.numel() else 0.0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def check(shape, dtype, n_dims=1, reduction="two-stage", block_size=None, view=None, affine=(True, True), seed=0):
    """y and every gradient of layer_norm against torch's layer_norm in fp64."""
    x = random_tensor(shape, torch.float32, seed=seed, scale=2.0, shift=0.5)
    x = (view(x) if view else x).to(dtype)
    normalized = tuple(x.shape[x.dim() - n_dims :])
    params = [random_tensor(normalized, dtype, seed=seed + i + 1) if on else None for i, on in enumerate(affine)]
    dy = random_tensor(tuple(x.shape), dtype, seed=seed + 3)
    ours = [None if t is None else t.detach().clone().requires_grad_() for t in (x, *params)]
    exact = [None if t is None else t.detach().double().requires_grad_() for t in (x, *params)]
    y = layer_norm(ours[0], normalized, *ours[1:], reduction=reduction, block_size=block_size)
    expected = torch.nn.functional.layer_norm(exact[0], normalized, *exact[1:])
    assert y.dtype == dtype and y.shape == x.shape
    assert_close_to(y, expected, dtype, "y")
    y.backward(dy)
    expected.backward(dy.double())
    # dx is a difference of terms of size rstd * |w dy|: up to 1/sqrt(eps) on a row with no spread.
    rows = exact[0].detach().reshape(-1, math.prod(normalized))
    w = exact[1].detach().reshape(-1) if affine[0] else 1.0
    rstd = (rows.var(1, unbiased=False) + 1e-5).rsqrt().max().item() if rows.numel() else 0.0
    dx_scale = rstd * (dy.double().reshape(-1, rows.shape[1]) * w).abs().max().item() if rows.numel() else 0.0
    for name, mine, reference, scale in zip(("dx", "dW", "dB"), ours, exact, (dx_scale, 1.0, 1.0), strict=True):
        if mine is not None:
            assert mine.grad.dtype == dtype and mine.grad.shape == mine.shape, name
            assert_close_to(mine.grad, reference.grad, dtype, name, scale)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "case",
    [
        dict(shape=(1, 1)),
        dict(shape=(1, 513)),  # one row, not a power of two
        dict(shape=(37, 1)),  # one column: x_hat is 0
        dict(shape=(3, 7, 33)),
        dict(shape=(2, 3, 5, 6), n_dims=3),
        dict(shape=(9, 300), block_size=128),  # rows split over 3 programs (chapter 13)
        dict(shape=(30, 48), view=lambda t: t[::3, 5:40]),  # rows 144 apart, offset start
        dict(shape=(24, 40), view=lambda t: t.t()),  # transposed: copied
        dict(shape=(17, 40), affine=(True, False)),
        dict(shape=(17, 40), affine=(False, True)),
        dict(shape=(17, 40), affine=(False, False)),
    ],
)
def test_matches_torch(case, dtype, reduction):
    check(dtype=dtype, reduction=reduction, **case)


@pytest.mark.parametrize("block_size", [None, 8])
@pytest.mark.parametrize("affine", [(True, False), (False, True), (False, False)])
def test_several_normalized_dimensions_with_partial_affine(affine, block_size):
    """Defect: with a bias and no weight over several dimensions, db took the last dimension's
    shape and the backward crashed; db must have normalized_shape."""
    check((4, 3, 5), torch.float32, n_dims=2, affine=affine, block_size=block_size)


def test_empty_batch():
    x = torch.empty(0, 3, 16, device=DEVICE, requires_grad=True)
    weight = torch.ones(16, device=DEVICE, requires_grad=True)
    bias = torch.zeros(16, device=DEVICE, requires_grad=True)
    y = layer_norm(x, 16, weight, bias)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(weight.grad, torch.zeros_like(weight))
    assert torch.equal(bias.grad, torch.zeros_like(bias))


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 30),
    cols=st.integers(1, 300),
    dtype=st.sampled_from(FLOAT_DTYPES),
    reduction=st.sampled_from(REDUCTIONS),
    block_size=st.sampled_from([None, 16, 128]),
)
def test_any_shape(rows, cols, dtype, reduction, block_size):
    check((rows, cols), dtype, reduction=reduction, block_size=block_size, seed=rows * cols)


@pytest.mark.parametrize("block_size", [None, 64])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_constant_rows_give_the_bias_and_finite_gradients(dtype, block_size):
    x = torch.full((5, 200), 7.5, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = random_tensor(200, dtype, seed=1).requires_grad_()
    bias = random_tensor(200, dtype, seed=2).requires_grad_()
    y = layer_norm(x, 200, weight, bias, block_size=block_size)
    torch.testing.assert_close(y, bias.detach().expand_as(y), rtol=0, atol=0)
    y.sum().backward()
    for grad in (x.grad, weight.grad, bias.grad):
        assert torch.isfinite(grad.float()).all()


@pytest.mark.parametrize("block_size", [None, 128])
def test_large_mean_keeps_its_precision(block_size):
    x = random_tensor((6, 1000), torch.float32, seed=3, shift=10_000.0)
    expected = torch.nn.functional.layer_norm(x.double(), (1000,))
    torch.testing.assert_close(layer_norm(x, 1000, block_size=block_size).double(), expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradients_repeat_to_the_bit_under_two_stage(reduction):
    x = random_tensor((50, 300), torch.float32, seed=4).requires_grad_()
    weight, bias = (random_tensor(300, torch.float32, seed=s).requires_grad_() for s in (5, 6))
    dy = random_tensor((50, 300), torch.float32, seed=7)
    y = layer_norm(x, 300, weight, bias, reduction=reduction)
    runs = [torch.autograd.grad(y, (x, weight, bias), dy, retain_graph=True) for _ in range(3)]
    if reduction == "two-stage" or not ON_GPU:  # the lock's order of additions varies on a GPU
        assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0], strict=True))


def test_double_backward_is_refused():
    """Defect: create_graph=True silently returned a gradient with no graph."""
    x = random_tensor((4, 16), torch.float32).requires_grad_()
    weight = random_tensor(16, torch.float32, seed=1).requires_grad_()
    y = layer_norm(x, 16, weight)
    with pytest.raises(RuntimeError, match="differentiated twice"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


@pytest.fixture
def deterministic(request):
    """torch.use_deterministic_algorithms(True, warn_only=request.param), undone after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=request.param)
    yield request.param
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("deterministic", [False, True], indirect=True, ids=["strict", "warn_only"])
def test_deterministic_mode_refuses_the_lock_reduction_and_takes_two_stage(deterministic):
    x = random_tensor((4, 16), torch.float32).requires_grad_()
    weight = random_tensor(16, torch.float32, seed=1).requires_grad_()
    if deterministic:  # warn_only: a warning, and the lock reduction runs
        with pytest.warns(UserWarning, match="two-stage"):
            layer_norm(x, 16, weight, reduction="lock").sum().backward()
    else:
        with pytest.raises(RuntimeError, match="reduction='two-stage'"):
            layer_norm(x, 16, weight, reduction="lock")
    runs = []
    for _ in range(2):  # the default: the same bits every run
        weight.grad = None
        layer_norm(x, 16, weight).square().sum().backward()
        runs.append(weight.grad.clone())
    assert torch.equal(*runs)
    with torch.no_grad():  # no dW or dB to reduce: nothing to refuse
        layer_norm(x, 16, weight, reduction="lock")


def test_no_gradient_for_frozen_parameters():
    x = random_tensor((4, 16), torch.float32).requires_grad_()
    weight = random_tensor(16, torch.float32, seed=1)  # requires_grad False
    layer_norm(x, 16, weight).sum().backward()
    assert x.grad is not None and weight.grad is None


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_module_is_a_drop_in_for_torch(reduction):
    ours = LayerNorm((4, 25), device=DEVICE, reduction=reduction)
    theirs = torch.nn.LayerNorm((4, 25), device=DEVICE)
    with torch.no_grad():
        theirs.weight.copy_(random_tensor((4, 25), seed=1))
        theirs.bias.copy_(random_tensor((4, 25), seed=2))
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = random_tensor((3, 4, 25), torch.float32, seed=10)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    for affine, bias in ((False, True), (True, False)):
        mine, torchs = LayerNorm(8, elementwise_affine=affine, bias=bias), torch.nn.LayerNorm(8, 1e-5, affine, bias)
        assert mine.state_dict().keys() == torchs.state_dict().keys()
        assert [n for n, _ in mine.named_parameters()] == [n for n, _ in torchs.named_parameters()]
    assert "reduction" in repr(ours)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x: layer_norm(x, 32), ValueError, "trailing dimensions"),
        (lambda x: layer_norm(x, (8, 64, 1)), ValueError, "trailing dimensions"),
        (lambda x: layer_norm(x, 64.0), TypeError, "ints"),
        (lambda x: layer_norm(x[:, :0], 0), ValueError, "zero dimension"),
        (lambda x: layer_norm(x.int(), 64), TypeError, "supported"),
        (lambda x: layer_norm(x.double(), 64), TypeError, "supported"),
        (lambda x: layer_norm(x, 64, torch.ones(32, device=DEVICE)), ValueError, "normalized_shape"),
        (lambda x: layer_norm(x, 64, None, torch.ones(64, device=DEVICE).half()), TypeError, "convert"),
        (lambda x: layer_norm(x, 64, [1.0] * 64), TypeError, "torch.Tensor"),
        # dB would come out in the weight's dtype (x's without one): torch refuses such a pair
        (
            lambda x: layer_norm(x.half(), 64, torch.ones(64, device=DEVICE).half(), torch.ones(64, device=DEVICE)),
            TypeError,
            "weight's dtype",
        ),
        (lambda x: layer_norm(x.half(), 64, None, torch.ones(64, device=DEVICE)), TypeError, "no weight given"),
        (lambda x: layer_norm(x, 64, eps=-1.0), ValueError, "non-negative"),
        (lambda x: layer_norm(x, 64, reduction="atomic"), ValueError, "choose one"),
        (lambda x: LayerNorm(64, reduction="atomic"), ValueError, "choose one"),  # when made
        (lambda x: layer_norm(x, 64, block_size=100), ValueError, "power of two"),
        (lambda x: layer_norm(x, 64, block_size=2.0), TypeError, "power of two"),
        (lambda x: layer_norm(x.to("meta"), 64), ValueError, "move it"),
    ],
)
def test_bad_input_is_refused_with_a_message(call, error, match):
    with pytest.raises(error, match=match):
        call(random_tensor((8, 64), torch.float32))


def test_numpy_numbers_are_taken_as_torch_takes_them():
    x = random_tensor((4, 10))
    want = torch.nn.functional.layer_norm(x, (10,), eps=1e-3)
    got = layer_norm(x, np.int64(10), eps=np.float32(1e-3))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(LayerNorm(np.int64(10), device=DEVICE)(x), torch.nn.functional.layer_norm(x, (10,)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["two-stage", "lock"])
@pytest.mark.parametrize("block_size", [None, 16])  # 16: rows split over programs (chapter 13)
def test_fp32_parameters_take_16_bit_input_as_torchs_do(dtype, reduction, block_size):
    x = random_tensor((9, 40), dtype, seed=1).requires_grad_()
    w, b = (random_tensor(40, torch.float32, seed=s).requires_grad_() for s in (2, 3))
    y = layer_norm(x, (40,), w, b, reduction=reduction, block_size=block_size)
    dy = random_tensor((9, 40), dtype, seed=4)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    exact = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = torch.nn.functional.layer_norm(exact[0], (40,), exact[1], exact[2])
    want_grads = torch.autograd.grad(want, exact, dy.double())
    assert y.dtype == dtype and [g.dtype for g in grads] == [dtype, torch.float32, torch.float32]
    unit = 2**-7 if dtype == torch.bfloat16 else 2**-10  # one rounding of the output's dtype
    torch.testing.assert_close(y.double(), want, rtol=2 * unit, atol=4 * unit)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=4 * unit, atol=8 * unit)
    assert LayerNorm(40, device=DEVICE)(x.detach()).dtype == dtype  # the module: the same


@pytest.mark.skipif(not ON_GPU, reason="under the interpreter, block_size caps test the split")
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape, n_dims", [((300, 40000), 1), ((5, 70000), 1), ((1, 262144), 1), ((130, 2, 8193), 2)])
def test_long_rows_split_over_programs_on_the_gpu(shape, n_dims, reduction):
    """Rows past one program's limits (chapter 13): the row's programs meet on a GPU."""
    for dtype in (torch.float32, torch.float16):
        check(shape, dtype, n_dims=n_dims, reduction=reduction)


@pytest.mark.skipif(not ON_GPU, reason="races show only on a GPU, where programs run at once")
@pytest.mark.parametrize("shape", [(16384, 4096), (16384, 1024), (2048, 40000)])
def test_lock_reduction_has_no_race_on_the_gpu(shape):
    """Many programs share each lock-guarded buffer: a lost update or a torn read would show
    as a dW or dB far from the two-stage reduction's (which has no lock to get wrong)."""
    x = random_tensor(shape, torch.float16, seed=11).requires_grad_()
    weight = random_tensor(shape[1], torch.float16, seed=12).requires_grad_()
    bias = random_tensor(shape[1], torch.float16, seed=13).requires_grad_()
    dy = random_tensor(shape, torch.float16, seed=14)

    def grads(reduction):
        y = layer_norm(x, shape[1], weight, bias, reduction=reduction)
        return torch.autograd.grad(y, (weight, bias), dy)

    reference = grads("two-stage")
    for _ in range(100):
        # Only the order of additions differs: one fp16 rounding of slack, no more.
        for mine, ref in zip(grads("lock"), reference, strict=True):
            torch.testing.assert_close(mine.float(), ref.float(), rtol=2e-3, atol=2e-3 * ref.abs().max().item())
