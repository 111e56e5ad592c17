"""The harness of chapter 06 (low-memory dropout): the fused layer against PyTorch given the
kernel's own mask, forward and backward, as the chapter describes. Hand-written; the function it
takes is the chapter's (in the notebook) or the package's, which is generated from the chapter."""

from __future__ import annotations

import itertools

from stepkernels.ops.dropout import scale_for
from stepkernels.runtime import activations
from stepkernels.runtime.core import DEVICE, FLOAT_DTYPES
import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def fused_mask(dropout_bias_act, shape, p: float, seed: int) -> torch.Tensor:
    """The elements that ``dropout_bias_act`` keeps: its output on ones, without activation."""
    ones = torch.ones(shape, device=DEVICE)
    zeros = torch.zeros(shape[-1], device=DEVICE)
    return dropout_bias_act(ones, zeros, p, None, seed) != 0


def check_fused_case(
    dropout_bias_act, x, bias, grad_out, p: float, activation, seed: int
):
    """y, dx and db of one case against PyTorch's, in fp32, given the kernel's mask: in x's
    dtype, to a few of its roundings, more for db (a sum over rows: sqrt(rows) times)."""
    x, bias = x.detach().requires_grad_(), bias.detach().requires_grad_()
    z = x.float() + bias.float()
    want = activations.activation_reference(z, activation) * scale_for(p)
    want = torch.where(fused_mask(dropout_bias_act, x.shape, p, seed), want, 0.0)
    out = dropout_bias_act(x, bias, p, activation, seed)
    ours = (out, *torch.autograd.grad(out, (x, bias), grad_out))
    theirs = (want, *torch.autograd.grad(want, (x, bias), grad_out.float()))
    scales = (1, 1, (x.numel() // x.shape[-1]) ** 0.5)
    for mine, wanted, scale in zip(ours, theirs, scales, strict=True):
        assert mine.dtype == x.dtype
        tol = TOLERANCE[x.dtype] * scale
        torch.testing.assert_close(mine.float(), wanted.float(), rtol=tol, atol=tol)


def check_fused(dropout_bias_act, shapes, p: float, seed: int) -> None:
    """``check_fused_case`` for every dtype, activation and shape, on ``randn`` inputs."""
    cases = itertools.product(FLOAT_DTYPES, activations.ACTIVATIONS, shapes)
    for dtype, activation, shape in cases:
        x = torch.randn(shape, device=DEVICE).to(dtype)
        bias = torch.randn(shape[-1], device=DEVICE).to(dtype)
        grad_out = torch.randn(shape, device=DEVICE).to(dtype)
        check_fused_case(dropout_bias_act, x, bias, grad_out, p, activation, seed)
    print(f"dropout_bias_act matches PyTorch, forward and backward: {shapes}")
