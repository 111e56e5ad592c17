"""The harness of chapter 09 (cross-entropy): one call checks a loss and its gradient against
PyTorch's in fp64, as the chapter describes. Hand-written; the function it takes is the
chapter's (in the notebook) or the package's, which is generated from the chapter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The loss is computed in fp32 and rounded once to the logits' dtype; the gradient likewise.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def targets(
    n_rows: int, n_cols: int, device, seed=0, ignored_every=3, ignore_index=-100
):
    """Random classes, every ``ignored_every``-th row ``ignore_index`` (0: none ignored)."""
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, n_cols, (n_rows,), generator=generator)
    if ignored_every:
        target[::ignored_every] = ignore_index
    return target.to(device)


def check(cross_entropy, logits, target, grad_scale=0.7, grad_atol=None, **options):
    """``cross_entropy(logits, target, **options)`` and its gradient (for a ``grad_loss`` of
    ``grad_scale``, not 1: the scaling path too) against ``F.cross_entropy`` in fp64, within a
    rounding of the logits' dtype (for the gradient relative to its largest value, or to
    ``grad_scale`` over the rows kept where that is larger, unless ``grad_atol`` says
    otherwise). NaN must be where PyTorch's is. Returns our loss and
    gradient."""
    logits = logits.detach().requires_grad_()  # detach keeps the strides
    loss = cross_entropy(logits, target, **options)
    x64 = logits.detach().double().requires_grad_()
    want = F.cross_entropy(x64, target.long(), **options)
    assert loss.dtype == logits.dtype and loss.shape == want.shape
    tolerance = TOLERANCE[logits.dtype]
    torch.testing.assert_close(
        loss.double(), want, rtol=tolerance, atol=tolerance, equal_nan=True
    )
    grad_loss = torch.full_like(want, grad_scale)
    (grad,) = torch.autograd.grad(loss, logits, grad_loss.to(loss.dtype))
    (want_grad,) = torch.autograd.grad(want, x64, grad_loss)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    largest = want_grad.abs().nan_to_num(0.0).max().item() if want_grad.numel() else 0.0
    # A gradient is (p - y) times grad_scale over the rows kept (for "mean"): p rounds
    # relative to 1, so where every row's p is near 0 or 1 (the largest gradient tiny) its
    # error is still a rounding of grad_scale / rows, not of the largest value.
    kept = target != options.get("ignore_index", -100)
    rows = int(kept.sum()) if options.get("reduction", "mean") == "mean" else 1
    scale = max(largest, abs(grad_scale) / max(rows, 1))
    atol = tolerance * scale if grad_atol is None else grad_atol
    torch.testing.assert_close(
        grad.double(), want_grad, rtol=tolerance, atol=atol, equal_nan=True
    )
    return loss, grad
