"""cross_entropy: the code of chapter 09, Cross-entropy for large vocabularies."""

# Generated from tutorials/09-cross-entropy.py by tools/export.py: edit the chapter, then `make
# export`.

from dataclasses import dataclass

from stepkernels._core import (
    FLOAT_DTYPES,
    check_tensor,
    refuse_double_backward,
    sm_count,
)
from stepkernels.launch import lean  # cheap repeated launches: chapter 08
from stepkernels.softmax import as_rows, quiet
import torch
import triton
import triton.language as tl


@triton.jit
def smoothed_target(cols, target, n_cols, smoothing, SMOOTH: tl.constexpr):
    """q over ``cols``: 1 - ε at the target, plus ε / V everywhere (ε = 0 unless SMOOTH)."""
    if SMOOTH:
        return tl.where(cols == target, 1.0 - smoothing, 0.0) + smoothing / n_cols
    return tl.where(cols == target, 1.0, 0.0)


@triton.jit
def row_loss(lse, target_dot, target, n_cols, ignore_index):
    """lse - sum_j q_j x_j; 0 for an ignored row, NaN for a target out of range."""
    loss = tl.where((target < 0) | (target >= n_cols), float("nan"), lse - target_dot)
    return tl.where(target == ignore_index, 0.0, loss)


@triton.jit
def loss_gradient(x, cols, target, lse, scale, n_cols, smoothing, ignore_index,
                  SMOOTH: tl.constexpr):  # fmt: skip
    """(softmax - q) * scale over ``cols``, with the same rules as ``row_loss``."""
    grad = (
        tl.exp(x - lse) - smoothed_target(cols, target, n_cols, smoothing, SMOOTH)
    ) * scale
    grad = tl.where((target < 0) | (target >= n_cols), float("nan"), grad)
    return tl.where(target == ignore_index, 0.0, grad)


@triton.jit
def row_statistics(x_row, target, n_cols, smoothing, BLOCK_N: tl.constexpr,
                   SMOOTH: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """One online pass over a row: its maximum, sum of exp(x - maximum) and sum_j q_j x_j."""
    cols = tl.arange(0, BLOCK_N)
    running_max = -float("inf")
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    lane_dot = tl.zeros([BLOCK_N], tl.float32)
    for start in tl.range(0, n_cols, BLOCK_N, num_stages=NUM_STAGES):
        offsets = start + cols
        in_row = offsets < n_cols
        x = tl.load(x_row + offsets, mask=in_row, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32)  # fmt: skip
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(running_max - shift) + tl.exp(x - shift)
        q = smoothed_target(offsets, target, n_cols, smoothing, SMOOTH)
        lane_dot += tl.where(in_row, q * x, 0.0)
        running_max = new_max
    return running_max, tl.sum(lane_sum, axis=0), tl.sum(lane_dot, axis=0)


@lean
@triton.jit
def cross_entropy_looped_kernel(
    logits_ptr, target_ptr, grad_ptr, loss_ptr, lse_ptr, grad_scale_ptr, n_rows, n_cols,
    logits_row_stride, grad_row_stride, ignore_index, smoothing, BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr, WRITE_GRAD: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        logits_row = logits_ptr + tl.cast(row, tl.int64) * logits_row_stride
        target = tl.load(target_ptr + row).to(tl.int64)
        row_max, row_sum, row_dot = row_statistics(
            logits_row, target, n_cols, smoothing, BLOCK_N, SMOOTH, NUM_STAGES
        )
        lse = row_max + tl.log(row_sum)
        tl.store(loss_ptr + row, row_loss(lse, row_dot, target, n_cols, ignore_index))
        tl.store(lse_ptr + row, lse)
        if WRITE_GRAD:
            scale = 1.0
            if HAS_GRAD_SCALE:
                scale = tl.load(grad_scale_ptr)
            grad_row = grad_ptr + tl.cast(row, tl.int64) * grad_row_stride
            for chunk in tl.range(0, n_chunks, num_stages=NUM_STAGES):
                cols = (n_chunks - 1 - chunk) * BLOCK_N + tl.arange(0, BLOCK_N)
                in_row = cols < n_cols
                x = tl.load(logits_row + cols, mask=in_row, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)  # fmt: skip
                grad = loss_gradient(x, cols, target, lse, scale, n_cols, smoothing,
                                     ignore_index, SMOOTH)  # fmt: skip
                tl.store(
                    grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=in_row
                )


@lean
@triton.jit
def scale_unless_one_kernel(grad_ptr, factor_ptr, n_elements, BLOCK: tl.constexpr):
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        first = tl.program_id(0).to(tl.int64) * BLOCK
        for start in range(first, n_elements, tl.num_programs(0) * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            in_range = offsets < n_elements
            grad = tl.load(grad_ptr + offsets, mask=in_range).to(tl.float32) * factor
            tl.store(
                grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=in_range
            )


@lean
@triton.jit
def cross_entropy_backward_kernel(
    logits_ptr, target_ptr, lse_ptr, row_scale_ptr, grad_ptr, n_cols, n_chunks,
    logits_row_stride, grad_row_stride, row_scale_stride, ignore_index, smoothing,
    BLOCK_N: tl.constexpr, SMOOTH: tl.constexpr,
):  # fmt: skip
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    cols = (tl.program_id(0) % n_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=in_row).to(tl.float32)
    target = tl.load(target_ptr + row).to(tl.int64)
    scale = tl.load(row_scale_ptr + row * row_scale_stride).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    grad = loss_gradient(
        x, cols, target, lse, scale, n_cols, smoothing, ignore_index, SMOOTH
    )
    grad_row = grad_ptr + row * grad_row_stride
    tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=in_row)


BACKWARD_BLOCK = 4096  # values per program of the backward kernel
SCALE_BLOCK, SCALE_PROGRAMS_PER_SM = 4096, 4
REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class Options:
    ignore_index: int
    smoothing: float
    reduction: str


@dataclass(frozen=True)
class Launch:
    block_n: int  # values per chunk of the loop
    num_warps: int
    programs_per_sm: int = 0  # a persistent grid; 0 launches a program per row
    num_stages: int = 2  # chunks loaded ahead


def default_launch(element_size: int, write_grad: bool) -> Launch:
    if write_grad:
        return Launch(4096, 8 if element_size == 4 else 4)
    return Launch(2048, 4)


def loss_rows(logits, target, options, grad=None, grad_scale=None, launch=None):
    """Per row: the loss and the lse, fp32. Writes the gradient into ``grad`` if given
    (``logits`` itself for in place), times ``grad_scale`` (one element) if given."""
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(losses)
    if n_rows == 0:
        return losses, lse
    launch = launch or default_launch(logits.element_size(), grad is not None)
    per_sm = launch.programs_per_sm
    grid = (min(n_rows, per_sm * sm_count()) if per_sm else n_rows,)
    with quiet():
        cross_entropy_looped_kernel[grid](
            logits, target, logits if grad is None else grad, losses, lse, grad_scale,
            n_rows, n_cols, logits.stride(0), 0 if grad is None else grad.stride(0),
            options.ignore_index, options.smoothing, BLOCK_N=launch.block_n,
            SMOOTH=options.smoothing > 0, WRITE_GRAD=grad is not None,
            HAS_GRAD_SCALE=grad_scale is not None, NUM_STAGES=launch.num_stages,
            num_warps=launch.num_warps,
        )  # fmt: skip
    return losses, lse


def gradient_rows(logits, target, lse, row_scale, options, grad=None):
    """softmax - q per row, times ``row_scale`` (one value, or one per row); in place when
    ``grad`` is ``logits``."""
    grad = torch.empty_like(logits) if grad is None else grad
    if grad.numel() == 0:
        return grad
    block = min(BACKWARD_BLOCK, triton.next_power_of_2(logits.shape[1]))
    n_chunks = triton.cdiv(logits.shape[1], block)
    with quiet():
        cross_entropy_backward_kernel[(logits.shape[0] * n_chunks,)](
            logits, target, lse, row_scale, grad, logits.shape[1], n_chunks,
            logits.stride(0), grad.stride(0), row_scale.stride(0) if row_scale.dim() else 0,
            options.ignore_index, options.smoothing, BLOCK_N=block,
            SMOOTH=options.smoothing > 0, num_warps=8,
        )  # fmt: skip
    return grad


def scale_unless_one(tensor, factor):
    """``tensor *= factor`` in place, skipped on the GPU (no synchronization) when it is 1."""
    if tensor.numel():
        grid = (min(triton.cdiv(tensor.numel(), SCALE_BLOCK),
                    SCALE_PROGRAMS_PER_SM * sm_count()),)  # fmt: skip
        scale_unless_one_kernel[grid](tensor, factor, tensor.numel(), BLOCK=SCALE_BLOCK)
    return tensor


def reduce_losses(losses, count, reduction):
    if reduction == "none":
        return losses
    return losses.sum() / count if reduction == "mean" else losses.sum()


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, options):
        count = target.ne(options.ignore_index).sum(dtype=torch.float32)
        grad = None if options.reduction == "none" else torch.empty_like(logits)
        scale = count.reciprocal() if options.reduction == "mean" else None
        losses, lse = loss_rows(logits, target, options, grad, scale)
        ctx.save_for_backward(logits, target, lse, count)
        ctx.options, ctx.grad = options, grad
        return reduce_losses(losses, count, options.reduction).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("cross_entropy", "torch.nn.functional.cross_entropy")
        if ctx.grad is not None:  # computed in the forward: hand it over, once
            grad, ctx.grad = ctx.grad, None
            return scale_unless_one(grad, grad_loss), None, None
        logits, target, lse, count = ctx.saved_tensors
        mean = ctx.options.reduction == "mean"
        row_scale = (grad_loss / count if mean else grad_loss).float()
        return gradient_rows(logits, target, lse, row_scale, ctx.options), None, None


def check_target(target, n_rows, ignore_index, label_smoothing, reduction) -> Options:
    check_tensor(target, "target")
    if target.is_floating_point() or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"target must hold class indices as int64 or int32, got {target.dtype}; class "
            "probabilities are not supported: convert indices with target.long()"
        )
    if target.shape != (n_rows,):
        raise ValueError(f"target must have shape ({n_rows},), one class per row, got "
                         f"{tuple(target.shape)}")  # fmt: skip
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return Options(int(ignore_index), float(label_smoothing), reduction)


def check_loss_inputs(
    logits, target, ignore_index, label_smoothing, reduction
) -> Options:
    check_tensor(logits, "logits", FLOAT_DTYPES)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"logits must be (tokens, vocabulary) with a vocabulary of at least 1, got shape "
            f"{tuple(logits.shape)}: flatten with logits.reshape(-1, logits.shape[-1]) (for "
            "(N, C, d1, ...) logits, move the class dimension last first)"
        )
    return check_target(
        target, logits.shape[0], ignore_index, label_smoothing, reduction
    )


def cross_entropy(
    logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean"
):
    """``torch.nn.functional.cross_entropy`` for (tokens, vocabulary) logits in fp32, fp16 or
    bf16 and integer targets, computed in fp32, with autograd. A target outside [0, V) that
    is not ``ignore_index`` gives NaN for its row."""
    options = check_loss_inputs(
        logits, target, ignore_index, label_smoothing, reduction
    )
    logits, target = as_rows(logits), target.contiguous()
    if logits.requires_grad and torch.is_grad_enabled():
        return CrossEntropyFunction.apply(logits, target, options)
    count = target.ne(options.ignore_index).sum(dtype=torch.float32)
    losses, _ = loss_rows(logits, target, options)
    return reduce_losses(losses, count, reduction).to(logits.dtype)
