"""ops.linear.column_sums (chapter 05): a bias gradient in one launch, against sums in fp64, and
the linear layer's backward taking its db from it."""

import pytest
from stepkernels import linear
from stepkernels.ops import linear as linear_module
from stepkernels.runtime import core
from stepkernels.runtime.core import DEVICE
import torch


def reference(x, dtype):
    return x.double().sum(dim=0).to(dtype)


def agree(got, x, dtype):
    """Summed in fp32 and rounded once: within an fp32 sum's error of fp64's, plus one
    rounding to ``dtype`` (the reference rounds too, and may land on the other side)."""
    want = x.double().sum(dim=0)
    assert got.dtype == dtype and got.shape == want.shape
    ulp = torch.finfo(dtype).eps * want.abs() + torch.finfo(dtype).tiny
    fp32 = 1e-6 * x.double().abs().sum(dim=0) * max(1, len(x)) ** 0.5
    assert ((got.double() - want).abs() <= ulp + fp32).all(), (got, want)


def counters_zero():
    return all(not t.any() for key, t in core._ZEROED.items() if key[0] == torch.device(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (37, 129), (300, 3), (1000, 70), (65, 600)])
def test_sums_over_rows_as_fp64_does(shape, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(DEVICE, dtype)
    for out in (torch.float32, dtype):
        agree(linear_module.column_sums(x, out), x, out)
    assert counters_zero(), "a launch left its column blocks' counters set"


@pytest.mark.parametrize("waves", [1, 4, 1000])
def test_any_number_of_programs_per_column_block(monkeypatch, waves):
    # One program a column block, a few with several row blocks each, or one row block each
    monkeypatch.setattr(linear_module, "COLUMN_SUMS_WAVES", waves)
    x = torch.randn(777, 200, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    agree(linear_module.column_sums(x), x, torch.float32)
    assert counters_zero()


def test_strided_inputs():
    x = torch.randn(90, 130, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for view in (x.t(), x[:, ::3], x[::2], x.expand(4, 90, 130)[1]):
        agree(linear_module.column_sums(view), view, torch.float32)
    broadcast = torch.ones((), device=DEVICE).expand(50, 7)  # y.sum()'s gradient: strides 0
    assert torch.equal(linear_module.column_sums(broadcast), torch.full((7,), 50.0, device=DEVICE))


def test_no_rows_or_no_columns():
    assert torch.equal(linear_module.column_sums(torch.empty(0, 6, device=DEVICE)), torch.zeros(6, device=DEVICE))
    assert linear_module.column_sums(torch.empty(5, 0, device=DEVICE)).shape == (0,)


def test_the_same_bits_every_call():
    x = torch.randn(4000, 300, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    first = linear_module.column_sums(x)
    assert all(torch.equal(first, linear_module.column_sums(x)) for _ in range(3))


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_db_from_column_sums(monkeypatch, activation, dtype):
    """db from one column_sums call, in the layer's dtype (no sum and cast after it), and
    equal to PyTorch's layer's."""
    calls, column_sums = [], linear_module.column_sums

    def spy(x, out_dtype=torch.float32):
        calls.append(out_dtype)
        return column_sums(x, out_dtype)

    monkeypatch.setattr(linear_module, "column_sums", spy)
    generator = torch.Generator().manual_seed(5)
    x, weight, bias = (torch.randn(s, generator=generator).to(DEVICE, dtype) for s in ((45, 20), (70, 20), (70,)))
    bias.requires_grad_()
    y = linear(x, weight, bias, activation)
    grad_y = torch.randn(y.shape, generator=generator).to(DEVICE, dtype)
    y.backward(grad_y)
    assert calls == [dtype]
    bias_ref = bias.detach().clone().requires_grad_()
    z = torch.nn.functional.linear(x.double(), weight.double(), bias_ref.double())
    (torch.nn.functional.gelu(z) if activation else z).backward(grad_y.double())
    low = dtype != torch.float32  # Z and dZ rounded to bf16: sums of 45 near-cancelling terms
    tolerance = dict(rtol=2e-2, atol=5e-2) if low else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad, bias_ref.grad.to(dtype), **tolerance)
