"""ops.linear_cross_entropy: the code of chapter 10, Linear + cross-entropy without the logits."""

# Generated from tutorials/10-linear-cross-entropy.py by tools/export.py: edit the chapter, then
# `make export`.

from stepkernels.ops.cross_entropy import (
    check_target,
    loss_rows,
    mean_scale,
    reduced_loss,
    scale_unless_one,
)
from stepkernels.ops.matmul import product
from stepkernels.runtime.arguments import (
    OPTIONAL_TENSOR_TYPES,
    TENSOR_TYPES,
    classes_in_range,
)
from stepkernels.runtime.core import (
    FLOAT_DTYPES,
    check_tensor,
    loss_dtype,
    refuse_double_backward,
)
from stepkernels.runtime.launch import lean_now, plan_cache
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
    whole = chunk >= n_rows  # one chunk: no slices, and dX written where it stays
    grad_x = None
    if needs[0] and not whole:
        grad_x = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    grad_w = None
    grad_b = torch.zeros(n_cols, device=x.device) if needs[2] else None
    per_row = grad_scale is not None and grad_scale.dim() > 0
    losses = []
    for start in range(0, n_rows, chunk):
        rows = slice(start, start + chunk)
        x_rows = x if whole else x[rows]
        # product: matmul without its checks, done once by linear_cross_entropy
        logits = product(x_rows, weight.mT, None, bias)
        grad = logits if any(needs) else None  # in place: our own buffer
        scale = grad_scale[rows] if per_row and not whole else grad_scale
        part = target if whole else target[rows]
        losses.append(loss_rows(logits, part, options, grad, scale))
        del grad
        if not any(needs):
            continue
        if needs[0] and whole:
            grad_x = product(logits, weight)
        elif needs[0]:
            grad_x[rows] = product(logits, weight)
        if needs[1]:  # the first chunk's product, then the others added to it
            grad_w = product(logits.mT, x_rows, None, None, False, grad_w)
        if needs[2]:
            grad_b += logits.sum(dim=0, dtype=torch.float32)
        del logits  # before the next chunk's: one chunk of logits at a time
    if needs[0] and grad_x is None:  # no tokens
        grad_x = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if needs[1] and grad_w is None:  # no tokens, no product
        grad_w = torch.zeros_like(weight)
    grads = (grad_x, grad_w, None if grad_b is None else grad_b.to(x.dtype))
    if len(losses) == 1:
        return losses[0], grads
    return torch.cat(losses) if losses else x.new_empty(0, dtype=torch.float32), grads


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, options, chunk_tokens):
        needs = ctx.needs_input_grad[:3]
        early = options.reduction != "none"  # the gradients now, as for cross_entropy
        scale = mean_scale(target, options)  # 1 / the rows kept, for "mean"
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
        ctx.save_for_backward(x, weight, bias, target, scale)
        ctx.options, ctx.chunk_tokens, ctx.grads = options, chunk_tokens, grads
        ctx.early = early
        return reduced_loss(losses, target, options, loss_dtype(x))

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("linear_cross_entropy", "cross_entropy(F.linear(...))")
        none = (None, None, None)
        if ctx.early:  # computed in the forward: hand them over, once
            grads, ctx.grads, ctx.early = ctx.grads, none, False
            return *(
                g if g is None else scale_unless_one(g, grad_loss) for g in grads
            ), *none
        x, weight, bias, target, scale = ctx.saved_tensors
        row_scale = (grad_loss if scale is None else grad_loss * scale).float()
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
    given = (ignore_index, label_smoothing, reduction, chunk_tokens)
    fast = type(x) is torch.Tensor and type(target) is torch.Tensor
    fast = fast and type(weight) in TENSOR_TYPES and type(bias) in OPTIONAL_TENSOR_TYPES
    fast = fast and type(ignore_index) is int and type(label_smoothing) in (int, float)
    fast = fast and type(reduction) is str and type(chunk_tokens) in (int, type(None))
    fast = fast and not torch.compiler.is_compiling() and lean_now()
    options = None
    if fast:  # a call seen before: checked then (the target's values: CPU's, each call)
        key = (x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device)
        key += (None,) if bias is None else (bias.shape, bias.dtype, bias.device)
        key = (*key, target.shape, target.dtype, target.device, *given)
        options = CHECKED_CALLS.get(key)
        if options is not None:
            classes_in_range(target, weight.shape[0], "target", ignore_index)
    if options is None:
        options = checked_options(x, weight, target, bias, *given)
        if fast:
            CHECKED_CALLS[key] = options
    if torch.compiler.is_compiling():  # an operator the compiler calls (below)
        return compiled_linear_cross_entropy(
            x, weight, bias, target, options, chunk_tokens
        )
    target = target.contiguous()
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        args = (x, weight, bias, target, options, chunk_tokens)
        return LinearCrossEntropyFunction.apply(*args)
    losses, _ = linear_loss_pass(
        x, weight, bias, target, options, (False,) * 3, chunk_tokens
    )
    return reduced_loss(losses, target, options, loss_dtype(x))


CHECKED_CALLS = plan_cache()  # calls' checked options, by what the checks read


def checked_options(
    x, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_tokens
):
    """The loss's options, once every argument is checked (raises, saying what to do)."""
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
    return check_target(target, shape, ignore_index, label_smoothing, reduction)


from stepkernels.ops.cross_entropy import Options
from torch import Tensor
from torch.library import custom_op


@custom_op("stepkernels::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    smoothing: float,
    reduction: str,
    chunk_tokens: int | None,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The loss, then (reduced) the gradients of x, weight and bias that ``needs`` asks
    for, each else empty."""
    options = Options(ignore_index, smoothing, reduction)
    early = needs if reduction != "none" else (False, False, False)
    scale = mean_scale(target, options)
    losses, grads = linear_loss_pass(
        x, weight, bias, target, options, early, chunk_tokens, grad_scale=scale
    )
    loss = reduced_loss(losses, target, options, loss_dtype(x))
    return loss, *(x.new_empty(0) if g is None else g for g in grads)


def gradient_shapes(x, weight, wanted):
    """Empty tensors shaped as the gradients of x, weight and bias where ``wanted``."""
    shapes = (x.shape, weight.shape, weight.shape[:1])
    return tuple(
        x.new_empty(s if w else (0,)) for s, w in zip(shapes, wanted, strict=True)
    )


@linear_cross_entropy_op.register_fake
def _(x, weight, bias, target, ignore_index, smoothing, reduction, chunk_tokens, needs):
    shape = (x.shape[0],) if reduction == "none" else ()
    early = needs if reduction != "none" else (False, False, False)
    return x.new_empty(shape, dtype=loss_dtype(x)), *gradient_shapes(x, weight, early)


@custom_op("stepkernels::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    row_scale: Tensor,
    ignore_index: int,
    smoothing: float,
    chunk_tokens: int | None,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients (reduction "none"), each row's times ``row_scale``."""
    options = Options(ignore_index, smoothing, "none")
    _, grads = linear_loss_pass(
        x, weight, bias, target, options, needs, chunk_tokens, row_scale.float()
    )
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@linear_cross_entropy_backward_op.register_fake
def _(x, weight, bias, target, row_scale, ignore_index, smoothing, chunk_tokens, needs):
    return gradient_shapes(x, weight, needs)


def linear_cross_entropy_setup(ctx, inputs, output):
    x, weight, bias, target, *ctx.options, ctx.chunk_tokens, ctx.needs = inputs
    ctx.save_for_backward(x, weight, bias, target, *output[1:])
    ctx.set_materialize_grads(False)  # the gradient outputs get none


def linear_cross_entropy_backward(ctx, grad_loss, *_grad_grads):
    refuse_double_backward("linear_cross_entropy", "cross_entropy(F.linear(...))")
    x, weight, bias, target, *grads = ctx.saved_tensors
    ignore_index, smoothing, reduction = ctx.options
    if reduction == "none":
        scaled = (x, weight, bias, target, grad_loss, ignore_index, smoothing)
        grads = linear_cross_entropy_backward_op(*scaled, ctx.chunk_tokens, ctx.needs)
    else:  # computed in the forward
        grads = [g * grad_loss for g in grads]
    grads = [g if need else None for g, need in zip(grads, ctx.needs, strict=True)]
    return *grads, None, None, None, None, None, None


linear_cross_entropy_op.register_autograd(
    linear_cross_entropy_backward, setup_context=linear_cross_entropy_setup
)


def compiled_linear_cross_entropy(x, weight, bias, target, options, chunk_tokens):
    tensors = (x, weight, bias)
    grads = torch.is_grad_enabled()
    needs = [grads and t is not None and t.requires_grad for t in tensors]
    chosen = (options.ignore_index, options.smoothing, options.reduction)
    args = (x, weight, bias, target.contiguous(), *chosen, chunk_tokens, needs)
    return linear_cross_entropy_op(*args)[0]
