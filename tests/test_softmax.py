"""stepkernels.softmax and log_softmax against torch, through the public functions only."""

import importlib
from pathlib import Path
import runpy

from conftest import random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
from stepkernels import log_softmax, softmax
from stepkernels.runtime.core import DEVICE, INTERPRET, ON_GPU
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FUNCTIONS = {"softmax": (softmax, torch.softmax), "log_softmax": (log_softmax, torch.log_softmax)}
# About one unit in the last place (relative); the interpreter truncates bf16 instead of rounding.
RTOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-6 if INTERPRET else 2**-7}
SPLIT_FORWARD = 32_771  # past 32,768 columns the forward splits each row over programs
SPLIT_BACKWARD = 16_387  # past 16,384 the backward splits each row over programs too


def expected(x, name):
    return FUNCTIONS[name][1](x.double(), dim=-1)


def assert_values(y, x, name):
    rtol = RTOL[x.dtype]
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    torch.testing.assert_close(y, expected(x, name).to(x.dtype), rtol=rtol, atol=rtol / 4, equal_nan=True)


def assert_gradient(x, name, seed=1):
    """dx through our backward against torch's in fp64; atol scales with the gradient."""
    x = x.detach().requires_grad_()
    dy = random_tensor(x.shape, x.dtype, seed)
    (dx,) = torch.autograd.grad(FUNCTIONS[name][0](x), x, dy)
    x64 = x.detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad(expected(x64, name), x64, dy.double())
    rtol = RTOL[x.dtype]
    atol = rtol * dx64.abs().nan_to_num(0.0, 0.0).max().item() if dx64.numel() else 0.0
    assert dx.dtype == x.dtype
    torch.testing.assert_close(dx, dx64.to(x.dtype), rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1,), (1, 1), (7,), (1, 781), (37, 100), (5, 3), (2, 3, 4, 65), (1, 1, 16), (4, 1024), (3, 4097)]
)
def test_values_and_gradients_match_torch(shape, dtype, name):
    x = random_tensor(shape, dtype, scale=4.0)
    assert_values(FUNCTIONS[name][0](x), x, name)
    assert_gradient(x, name)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_take_the_split_forward_and_split_backward(dtype, name):
    x = random_tensor((2, SPLIT_FORWARD), dtype, scale=4.0)
    assert_values(FUNCTIONS[name][0](x), x, name)
    assert_gradient(random_tensor((2, SPLIT_BACKWARD), dtype, scale=4.0), name)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_long_rows_with_masked_chunks(name):
    """-inf over whole chunks and a row of only -inf, on the split forward and backward."""
    x = random_tensor((3, SPLIT_FORWARD), torch.float32, scale=4.0)
    x[0, :20_000] = -float("inf")  # the first chunks of the row are all masked
    x[1] = -float("inf")  # nothing left: NaN, as in torch
    x[2, 5::7] = -float("inf")
    y = FUNCTIONS[name][0](x)
    assert_values(y, x, name)
    assert torch.isnan(y[1]).all()
    assert_gradient(x[[0, 2], :SPLIT_BACKWARD], name)


@settings(max_examples=20, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=0, max_size=2).flatmap(
        lambda lead: st.integers(1, 600).map(lambda n: (*lead, n))
    ),
    dtype=st.sampled_from(DTYPES),
    name=st.sampled_from(list(FUNCTIONS)),
    seed=st.integers(0, 2**31),
)
def test_any_shape(shape, dtype, name, seed):
    x = random_tensor(shape, dtype, seed, scale=4.0)
    assert_values(FUNCTIONS[name][0](x), x, name)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), (2, 0, 4)])
def test_empty_input(shape, name):
    x = torch.empty(shape, device=DEVICE, requires_grad=True)
    y = FUNCTIONS[name][0](x)
    assert y.shape == shape
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert dx.shape == shape


@pytest.mark.parametrize("name", FUNCTIONS)
def test_non_contiguous_inputs_and_their_gradients(name):
    base = random_tensor((12, 40), torch.float32, scale=4.0)
    views = {
        "strided slice": base[:, 5:30],
        "every other row": base[::2],
        "transposed": base.t(),
        "expanded row": base[0].expand(5, 40),
        "permuted 3-d": base.view(3, 4, 40).permute(1, 0, 2),
    }
    for view in views.values():
        assert_values(FUNCTIONS[name][0](view), view, name)
        assert_gradient(view.contiguous(), name)  # gradients flow back into the view's base
    base.requires_grad_()
    loss = (FUNCTIONS[name][0](base.t()) * torch.arange(12.0, device=DEVICE)).sum()
    loss.backward()
    base64 = base.detach().double().requires_grad_()
    (expected(base64.t(), name) * torch.arange(12.0, device=DEVICE)).sum().backward()
    # fp32 rounding of a sum over 40 terms weighted up to 11: scale atol with the largest.
    torch.testing.assert_close(base.grad, base64.grad.float(), rtol=1e-5, atol=1e-5 * base64.grad.abs().max().item())


def test_inputs_are_left_untouched():
    x = random_tensor((5, 70), torch.float16)
    x0 = x.clone()
    softmax(x), log_softmax(x)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_minus_infinity_and_large_values(name):
    x = random_tensor((4, 50), torch.float32, scale=4.0)
    x[0, ::3] = -float("inf")  # masked entries: probability 0
    x[1] = -float("inf")  # nothing left: NaN, as in torch
    x[2, 7] = -float("inf")
    x[3, :3] = torch.tensor([1000.0, 999.0, -1000.0])  # exp would overflow unshifted
    y = FUNCTIONS[name][0](x)
    assert_values(y, x, name)
    assert torch.isnan(y[1]).all()
    if name == "softmax":
        assert (y[0, ::3] == 0).all()
        torch.testing.assert_close(y[[0, 2, 3]].sum(-1), torch.ones(3, device=DEVICE))


@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double")
@pytest.mark.parametrize("name", FUNCTIONS)
def test_gradcheck_in_fp32(name):
    x = random_tensor((3, 11), torch.float32).requires_grad_()
    # Finite differences in fp32: coarse steps and loose tolerances.
    assert torch.autograd.gradcheck(FUNCTIONS[name][0], (x,), eps=1e-2, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_second_derivative_is_refused(name):
    """Defect: create_graph=True used to return a gradient with no graph, silently."""
    x = random_tensor((4, 30), torch.float32).requires_grad_()
    y = FUNCTIONS[name][0](x)
    with pytest.raises(RuntimeError, match=f"{name} cannot be differentiated twice.*torch.{name}"):
        torch.autograd.grad(y, x, torch.ones_like(y), create_graph=True)
    (dx,) = torch.autograd.grad(FUNCTIONS[name][0](x), x, torch.ones_like(y))  # first order still works
    assert dx.shape == x.shape


x = random_tensor((8, 10), torch.float32)
BAD_INPUTS = {
    "integer dtype": (x.int(), TypeError, "supported"),
    "bool": (x > 0, TypeError, "supported"),
    "float64": (x.double(), TypeError, "supported"),
    "0-dim": (x[0, 0], ValueError, "reshape"),
    "wrong device": (x.to("meta"), ValueError, "move it"),
    "not a tensor": ([1.0, 2.0], TypeError, "torch.Tensor"),
}


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_refused_with_advice(case, name):
    bad, error, advice = BAD_INPUTS[case]
    with pytest.raises(error, match=advice):
        FUNCTIONS[name][0](bad)


@pytest.mark.parametrize("log", ["False", 0, None])
def test_log_must_be_a_bool(log):
    """A string "False" is truthy: it gave log_softmax without a word."""
    with pytest.raises(TypeError, match="log must be True or False"):
        softmax(x, log=log)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the script also benchmarks; run it by hand")
def test_looped_backward_experiment_checks_out_under_the_interpreter(capsys):
    """lab/softmax_split_backward.py (chapter 02's exercise 3) against torch."""
    script = Path(__file__).resolve().parent.parent / "lab/softmax_split_backward.py"
    runpy.run_path(str(script), run_name="check")["check"]()  # importing it runs nothing
    assert "backward match torch.autograd" in capsys.readouterr().out


def test_split_launches_take_their_warps():
    """The split kernels run with the warps their launch rule names (a split launch once took
    Launch's default of 4 for the forward's 8: Nsight Compute showed 128 threads a program)."""
    module = importlib.import_module("stepkernels.ops.softmax")  # the package's softmax is a function

    for backward, (values, warps) in ((False, module.SPLIT_FORWARD), (True, module.SPLIT_BACKWARD)):
        launch = module.default_launch(2**16, backward=backward)
        assert (launch.kernel, launch.block_n, launch.num_warps) == ("split", values, warps)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_any_dim_as_torch(dim, name):
    """torch's signature (issue 46): softmax(x, dim), dim by position or keyword, negative
    from the end; a dim other than the last is moved last. Values and gradients."""
    ours, theirs = FUNCTIONS[name]
    x = random_tensor((3, 5, 7), scale=4.0).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    got, want = ours(x, dim), theirs(x64, dim)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours(x, dim=dim), got, rtol=0, atol=0)
    dy = random_tensor(x.shape, seed=2)
    (dx,) = torch.autograd.grad(got, x, dy)
    (dx64,) = torch.autograd.grad(want, x64, dy.double())
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-5)


def test_positional_dim_and_the_log_keyword_as_before():
    x = random_tensor((4, 9), scale=4.0)
    torch.testing.assert_close(softmax(x, -1), torch.nn.functional.softmax(x, -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(softmax(x, log=True), torch.log_softmax(x, -1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(softmax(x, 0, log=True), log_softmax(x, 0), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"dim 2 is out of range for x of 2 dimensions: pass one in \[-2, 1\]"):
        softmax(x, 2)
    with pytest.raises(TypeError, match="dim must be an int"):
        softmax(x, 1.0)
