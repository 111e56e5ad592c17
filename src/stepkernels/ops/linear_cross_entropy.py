"""ops.linear_cross_entropy: the code of chapter 10, Linear + cross-entropy without the logits."""

# Generated from tutorials/10-linear-cross-entropy.py by tools/export.py: edit the chapter, then
# `make export`.

from stepkernels.ops.cross_entropy import (
    check_target,
    kept_rows,
    loss_rows,
    reduce_losses,
    scale_unless_one,
)
from stepkernels.ops.matmul import matmul
from stepkernels.runtime.core import (
    FLOAT_DTYPES,
    check_tensor,
    loss_dtype,
    refuse_double_backward,
)
import torch

LOGITS_CHUNK_BYTES = 2**28  # logits held at once by linear_cross_entropy: 256 MiB


def chunk_rows(n_rows: int, n_cols: int, itemsize: int, chunk_tokens=None) -> int:
    """Tokens per chunk: a multiple of 128 (whole matmul tiles) within the budget."""
    if chunk_tokens is None:
        chunk_tokens = 128 * max(1, LOGITS_CHUNK_BYTES // (n_cols * itemsize) // 128)
    return max(1, min(n_rows, chunk_tokens))


def linear_loss_pass(
    x, weight, bias, target, options, needs, chunk_tokens=None, grad_scale=None
):
    """One pass over chunks of tokens: the loss per row, and the gradients that
    ``needs`` asks for (of x, weight, bias) times ``grad_scale``: None (1), one value or
    one per row."""
    n_rows, n_cols = x.shape[0], weight.shape[0]
    chunk = chunk_rows(n_rows, n_cols, x.element_size(), chunk_tokens)
    grad_x = torch.empty(x.shape, device=x.device, dtype=x.dtype) if needs[0] else None
    grad_w = None
    grad_b = torch.zeros(n_cols, device=x.device) if needs[2] else None
    per_row = grad_scale is not None and grad_scale.dim() > 0
    losses = []
    for start in range(0, n_rows, chunk):
        rows = slice(start, start + chunk)
        logits = matmul(x[rows], weight.mT, bias=bias)
        grad = logits if any(needs) else None  # in place: our own buffer
        scale = grad_scale[rows] if per_row else grad_scale
        losses.append(loss_rows(logits, target[rows], options, grad, scale))
        del grad
        if not any(needs):
            continue
        if needs[0]:
            grad_x[rows] = matmul(logits, weight)
        if needs[1]:
            accumulate = {} if grad_w is None else {"accumulate": grad_w}
            grad_w = matmul(logits.mT, x[rows], **accumulate)
        if needs[2]:
            grad_b += logits.sum(dim=0, dtype=torch.float32)
        del logits  # before the next chunk's: one chunk of logits at a time
    if needs[1] and grad_w is None:  # no tokens, no product
        grad_w = torch.zeros_like(weight)
    grads = (grad_x, grad_w, None if grad_b is None else grad_b.to(x.dtype))
    return torch.cat(losses) if losses else x.new_empty(0, dtype=torch.float32), grads


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, options, chunk_tokens):
        needs = ctx.needs_input_grad[:3]
        count = kept_rows(target, options)
        early = options.reduction != "none"  # the gradients now, as for cross_entropy
        scale = None if count is None else count.reciprocal()
        losses, grads = linear_loss_pass(
            x,
            weight,
            bias,
            target,
            options,
            needs if early else (False,) * 3,
            chunk_tokens,
            grad_scale=scale,
        )
        ctx.save_for_backward(x, weight, bias, target, count)
        ctx.options, ctx.chunk_tokens, ctx.grads = options, chunk_tokens, grads
        ctx.early = early
        return reduce_losses(losses, count, options.reduction).to(loss_dtype(x))

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("linear_cross_entropy", "cross_entropy(F.linear(...))")
        none = (None, None, None)
        if ctx.early:  # computed in the forward: hand them over, once
            grads, ctx.grads, ctx.early = ctx.grads, none, False
            return *(
                g if g is None else scale_unless_one(g, grad_loss) for g in grads
            ), *none
        x, weight, bias, target, count = ctx.saved_tensors
        row_scale = (grad_loss if count is None else grad_loss / count).float()
        _, grads = linear_loss_pass(
            x,
            weight,
            bias,
            target,
            ctx.options,
            ctx.needs_input_grad[:3],
            ctx.chunk_tokens,
            grad_scale=row_scale,
        )
        return *grads, *none


def linear_cross_entropy(
    x,
    weight,
    target,
    bias=None,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    reduction="mean",
    chunk_tokens=None,
):
    """``cross_entropy(x @ weight.T + bias, target)`` for x (tokens, hidden) and weight
    (vocabulary, hidden) of one dtype, with autograd, never holding more than
    ``chunk_tokens`` rows of logits (default: 256 MiB of them). A target outside [0, V)
    that is not ``ignore_index`` is an error, as for ``cross_entropy``: a ValueError for CPU
    tensors, a device-side assert on a GPU."""
    check_tensor(x, "x", FLOAT_DTYPES)
    check_tensor(weight, "weight", FLOAT_DTYPES)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x must be (tokens, hidden) and weight (vocabulary, hidden), got x "
            f"{tuple(x.shape)} and weight {tuple(weight.shape)}: flatten x with "
            "x.reshape(-1, x.shape[-1])"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"weight needs at least one row, got {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(
            f"weight is {weight.dtype} but x is {x.dtype}: one dtype for both, "
            "convert one with .to(...)"
        )
    if bias is not None:
        check_tensor(bias, "bias", (x.dtype,))
        if bias.shape != weight.shape[:1]:
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
    if chunk_tokens is not None and type(chunk_tokens) is not int:
        raise TypeError(f"chunk_tokens must be an int or None, got {chunk_tokens!r}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    shape = (x.shape[0], weight.shape[0])  # the logits'
    options = check_target(target, shape, ignore_index, label_smoothing, reduction)
    return LinearCrossEntropyFunction.apply(
        x, weight, bias, target.contiguous(), options, chunk_tokens
    )
