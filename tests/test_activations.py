"""stepkernels.activations: each activation and its derivative, evaluated in a tiny kernel,
against torch and torch's autograd."""

import pytest
from stepkernels.runtime.activations import (
    ACTIVATIONS,
    activation_derivative,
    activation_reference,
    apply_activation,
    check_activation,
)
from stepkernels.runtime.core import DEVICE
import torch
import triton
import triton.language as tl


@triton.jit
def evaluate_kernel(z_ptr, y_ptr, dy_ptr, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    z = tl.load(z_ptr + offsets)
    out = y_ptr.dtype.element_ty  # fp16 outputs take GELU's cheaper fit
    tl.store(y_ptr + offsets, apply_activation(z, ACTIVATION, out).to(out))
    tl.store(dy_ptr + offsets, activation_derivative(z, ACTIVATION, out).to(out))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_and_derivative_match_torch(activation):
    # Both sides of 0, 0 itself, and the tails where GELU's erf saturates.
    z = torch.linspace(-6, 6, 257, device=DEVICE)[:-1].requires_grad_()
    y, dy = torch.empty_like(z), torch.empty_like(z)
    evaluate_kernel[(1,)](z.detach(), y, dy, ACTIVATION=activation, BLOCK=256)
    expected = activation_reference(z, activation)
    expected.sum().backward()
    torch.testing.assert_close(y, expected.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dy, z.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_nan_and_infinities_come_out_as_torchs(activation):
    """A NaN stays NaN (tl.maximum would drop it: relu gave 0); slopes at NaN and 0 as torch's;
    GELU's +-inf give its limits (it computed inf - inf x 0)."""
    z = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0] * 4, device=DEVICE)
    z = z.requires_grad_()
    y, dy = torch.empty_like(z), torch.empty_like(z)
    evaluate_kernel[(1,)](z.detach(), y, dy, ACTIVATION=activation, BLOCK=16)
    expected = activation_reference(z, activation)
    expected.sum().backward()
    if activation == "gelu":  # the limits, inf and 0: torch's gives NaN (CPU: both, GPU: -inf)
        expected = torch.where(z.isinf(), z.detach().clamp(min=0), expected)
    torch.testing.assert_close(y, expected.detach(), equal_nan=True)
    finite = ~z.isinf()  # at +-inf torch's slopes come from 0 x inf and the like
    torch.testing.assert_close(dy[finite], z.grad[finite], equal_nan=True)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_16_bit_outputs_are_within_their_rounding(activation):
    z = torch.linspace(-6, 6, 257, device=DEVICE)[:-1].requires_grad_()
    y, dy = (torch.empty(256, device=DEVICE, dtype=torch.float16) for _ in "yd")
    evaluate_kernel[(1,)](z.detach(), y, dy, ACTIVATION=activation, BLOCK=256)
    expected = activation_reference(z, activation)
    expected.sum().backward()
    torch.testing.assert_close(y.float(), expected.detach(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(dy.float(), z.grad, atol=1e-3, rtol=1e-3)


def test_reference_matches_torch_functional():
    z = torch.randn(64)
    assert torch.equal(activation_reference(z, None), z)
    assert torch.equal(activation_reference(z, "relu"), torch.relu(z))
    assert torch.equal(activation_reference(z, "squared_relu"), torch.relu(z) ** 2)
    assert torch.equal(activation_reference(z, "leaky_relu"), torch.nn.functional.leaky_relu(z, 0.01))
    assert torch.equal(activation_reference(z, "gelu"), torch.nn.functional.gelu(z))


@pytest.mark.parametrize("name", ["tanh", "swish", "ReLU", ""])
def test_unknown_activations_are_refused(name):
    with pytest.raises(ValueError, match="choose one of"):
        check_activation(name)
    with pytest.raises(ValueError, match="choose one of"):
        activation_reference(torch.ones(2), name)
