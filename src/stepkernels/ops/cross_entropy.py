"""ops.cross_entropy: the code of chapter 09, Cross-entropy for large vocabularies."""

# Generated from tutorials/09-cross-entropy.py by tools/export.py: edit the chapter, then `make
# export`.

from dataclasses import dataclass
import functools

from stepkernels.runtime.arguments import cross_entropy_arguments
from stepkernels.runtime.core import (
    FLOAT_DTYPES,
    ON_GPU,
    check_tensor,
    loss_dtype,
    refuse_double_backward,
    sm_count,
)
from stepkernels.runtime.launch import lean  # cheap repeated launches: chapter 08
from stepkernels.runtime.rows import as_rows, quiet
import torch
import triton
import triton.language as tl


@triton.jit
def row_span(row, row_stride, n_cols, ALIGN: tl.constexpr, ALIGNED: tl.constexpr):
    """A row read in 16-byte groups of ALIGN values: the offset of its first group, the
    previous row's values that lead it there, the end of its last whole group and of its
    last group, counted from the first."""
    start = row.to(tl.int64) * row_stride
    if ALIGNED:  # every row starts and ends on a group boundary
        n_cols = tl.multiple_of(n_cols, ALIGN)
        return tl.multiple_of(start, ALIGN), 0, n_cols, n_cols
    lead = (start % ALIGN).to(tl.int32)
    last = tl.multiple_of((n_cols + lead) // ALIGN * ALIGN, ALIGN)
    padded = tl.multiple_of(tl.cdiv(n_cols + lead, ALIGN) * ALIGN, ALIGN)
    return tl.multiple_of(start - lead, ALIGN), lead, last, padded


@triton.jit
def arrive_and_wait(counter_ptr, n_parts, MAX_POLLS: tl.constexpr):
    """Count this program in (its stores ordered before), then poll until all
    ``n_parts`` have counted, at most MAX_POLLS times. True if they all did."""
    tl.debug_barrier()  # every thread of this program has stored
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel") + 1
    polls = 0
    while (arrived < n_parts) & (polls < MAX_POLLS):
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire")
        polls += 1
    return arrived >= n_parts


@triton.jit
def combine_parts(part_stats, n_parts, PARTS_POW2: tl.constexpr):
    """The row's max, sum of exp(x - max) and sum of x, from its parts' triples."""
    parts = tl.arange(0, PARTS_POW2)
    present = parts < n_parts
    maxima = tl.load(part_stats + parts, present, -float("inf"), volatile=True)
    sums = tl.load(part_stats + PARTS_POW2 + parts, present, 0.0, volatile=True)
    x_sums = tl.load(part_stats + 2 * PARTS_POW2 + parts, present, 0.0, volatile=True)
    row_max = tl.max(maxima, axis=0)
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    # A part of only -inf has sum 0 and weight exp(-inf) = 0: never 0 * overflow.
    row_sum = tl.sum(tl.where(present, sums * tl.exp(maxima - shift), 0.0), axis=0)
    return row_max, row_sum, tl.sum(x_sums, axis=0)


@triton.jit
def online_row_statistics(x_row, n_cols, BLOCK_N: tl.constexpr):
    """The same three numbers from one online pass over the row (the fallback)."""
    running_max = -float("inf")
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    lane_x = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, cols < n_cols, -float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(running_max - shift) + tl.exp(x - shift)
        lane_x += tl.where(cols < n_cols, x, 0.0)
        running_max = new_max
    return running_max, tl.sum(lane_sum, axis=0), tl.sum(lane_x, axis=0)


@lean
@triton.jit
def cross_entropy_kernel(
    logits_ptr,
    target_ptr,
    grad_ptr,
    loss_ptr,
    scale_ptr,
    stats_ptr,
    counter_ptr,
    n_cols,
    n_parts,
    row_stride,
    scale_stride,
    ignore_index,
    smoothing,
    PART: tl.constexpr,
    PARTS_POW2: tl.constexpr,
    SMOOTH: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ALIGN: tl.constexpr,
    ALIGNED: tl.constexpr,
    MAX_POLLS: tl.constexpr,
):
    row, part = tl.program_id(0) // n_parts, tl.program_id(0) % n_parts
    span, lead, last, padded = row_span(row, row_stride, n_cols, ALIGN, ALIGNED)
    offsets = part * PART + tl.arange(0, PART)  # from the row's first group
    x = tl.load(
        logits_ptr + span + offsets,
        offsets < padded,
        -float("inf"),
        eviction_policy="evict_first",
    ).to(tl.float32)
    in_row = (offsets >= lead) & (offsets < n_cols + lead)
    edge = part == 0  # a part holding a group shared with a neighbouring row
    if not ALIGNED:
        edge = (part == 0) | ((part + 1) * PART > last)
        if edge:
            x = tl.where(in_row, x, -float("inf"))
    target = tl.load(target_ptr + row).to(tl.int64)
    in_range = (target >= 0) & (target < n_cols)
    tl.device_assert(in_range | (target == ignore_index), "target outside [0, V)")
    # x_t before any program of the row writes its gradient, maybe over the logits
    x_target = tl.load(logits_ptr + span + lead + target, in_range, 0.0).to(tl.float32)
    part_max = tl.max(x, axis=0)
    shift = tl.where(part_max == -float("inf"), 0.0, part_max)
    e = tl.exp(x - shift)  # kept in registers for the gradient
    part_sum = tl.sum(e, axis=0)
    part_x = tl.zeros_like(part_sum)
    if SMOOTH:
        part_x = tl.sum(tl.where(in_row, x, 0.0), axis=0)
    row_max, row_sum, row_x = part_max, part_sum, part_x
    finisher = part == 0  # writes the row's loss
    if n_parts > 1:  # publish the triple, then combine the row's
        part_stats = stats_ptr + row.to(tl.int64) * 3 * PARTS_POW2
        tl.store(part_stats + part, part_max)
        tl.store(part_stats + PARTS_POW2 + part, part_sum)
        tl.store(part_stats + 2 * PARTS_POW2 + part, part_x)
        if WRITE_GRAD:  # everyone needs lse: wait for the others
            if arrive_and_wait(counter_ptr + row, n_parts, MAX_POLLS):
                row_max, row_sum, row_x = combine_parts(part_stats, n_parts, PARTS_POW2)
            else:  # the others are not running: read the row ourselves
                row_max, row_sum, row_x = online_row_statistics(
                    logits_ptr + span + lead, n_cols, 1024
                )
        else:  # the loss alone: the last to arrive finishes the row, nobody waits
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel")
            finisher = arrived == n_parts - 1
            if finisher:
                row_max, row_sum, row_x = combine_parts(part_stats, n_parts, PARTS_POW2)
    lse = row_max + tl.log(row_sum)
    if finisher:
        target_dot = x_target  # sum_j q_j x_j
        if SMOOTH:
            target_dot = (1.0 - smoothing) * x_target + smoothing / n_cols * row_x
        loss = tl.where(in_range, lse - target_dot, float("nan"))
        tl.store(loss_ptr + row, tl.where(target == ignore_index, 0.0, loss))
    if WRITE_GRAD:
        scale = 1.0
        if HAS_SCALE:
            scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        scale = tl.where(in_range, scale, float("nan"))  # out of range: NaN
        scale = tl.where(target == ignore_index, 0.0, scale)  # ignored: zero
        # q: 1 - ε + ε/V at the target, ε/V elsewhere; 32-bit offsets to compare
        target_offset = (tl.where(in_range, target, -1) + lead).to(tl.int32)
        q_miss = smoothing / n_cols
        q_hit = 1.0 - smoothing + q_miss
        q = tl.where(offsets == target_offset, q_hit, q_miss)
        grad = (e * tl.exp(shift - lse) - q) * scale
        grad_ptrs = grad_ptr + span + offsets
        if ALIGNED:
            tl.store(grad_ptrs, grad.to(grad_ptr.dtype.element_ty), offsets < padded)
        elif not edge:  # whole groups of this row only
            tl.store(grad_ptrs, grad.to(grad_ptr.dtype.element_ty))
        else:  # whole groups of this row, then the row's values in the shared ones
            first = tl.multiple_of(tl.where(lead > 0, ALIGN, 0), ALIGN)
            whole = (offsets >= first) & (offsets < last)
            tl.store(grad_ptrs, grad.to(grad_ptr.dtype.element_ty), whole)
            if part == 0:
                index = tl.arange(0, 2 * ALIGN)
                shared = tl.where(index < ALIGN, index, last + index - ALIGN)
                in_shared = (shared < first) | (shared >= tl.maximum(first, last))
                ours = (shared >= lead) & (shared < n_cols + lead) & in_shared
                x_shared = tl.load(logits_ptr + span + shared, ours).to(tl.float32)
                q_shared = tl.where(shared == target_offset, q_hit, q_miss)
                grad_shared = (tl.exp(x_shared - lse) - q_shared) * scale
                grad_shared = grad_shared.to(grad_ptr.dtype.element_ty)
                tl.store(grad_ptr + span + shared, grad_shared, ours)


SCALE_BLOCK, SCALE_PROGRAMS_PER_SM = 4096, 4
REDUCTIONS = ("mean", "sum", "none")
MAX_POLLS = 100_000 if ON_GPU else 2  # tries before a program reads the row itself
WAIT = 2**31 - 1 if ON_GPU else 2  # in place: wait as long as it takes
ASSERTS = {"debug": True, "sanitize_overflow": False}  # asserts in, overflow checks out


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
            tl.store(grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), in_range)


@dataclass(frozen=True)
class Options:
    ignore_index: int
    smoothing: float
    reduction: str


@dataclass(frozen=True)
class Launch:
    part: int  # values per program: a power of two
    num_warps: int
    max_registers: int | None = None  # per thread: more programs fit an SM


@functools.cache
def default_launch(n_values: int, element_size: int, write_grad: bool, aligned: bool):
    """For rows of ``n_values`` values from their first 16-byte group to their last."""
    whole_row = triton.next_power_of_2(n_values)
    if not write_grad:  # the loss alone: nobody waits
        part = whole_row if whole_row <= 16384 else 8192
        return Launch(part, max(4, part // 2048))
    # 32 values a thread, at most 64 registers: 32 warps an SM (rows off the grid spill there)
    if whole_row <= 32768:  # the row in one program: no waiting
        return Launch(whole_row, max(4, whole_row // 1024), max_registers=64)
    if not aligned:
        return Launch(4096, 4)
    return Launch(32768 // element_size, 32 // element_size, max_registers=64)  # 32 KB


def rows_aligned(t: torch.Tensor, align: int) -> bool:
    """Do the rows of ``t`` start and end on 16-byte boundaries (``align`` values)?"""
    return t.data_ptr() % 16 == 0 and t.stride(0) % align == t.shape[1] % align == 0


def empty_rows_like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor with ``t``'s shape, strides and address modulo 16 bytes."""
    lead = t.data_ptr() % 16 // t.element_size()
    if t.numel() == 0 or (lead == 0 and t.is_contiguous()):
        return torch.empty_like(t)
    size = lead + t.stride(0) * (t.shape[0] - 1) + t.shape[1]
    storage = torch.empty(size, device=t.device, dtype=t.dtype)
    return storage.as_strided(t.shape, t.stride(), lead)


def loss_rows(logits, target, options, grad=None, scale=None, launch=None):
    """The loss of each row, fp32. Writes the gradient into ``grad`` if given (laid out
    as ``logits``, or ``logits`` itself: in place), times ``scale``: one value or one
    per row."""
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    if n_rows == 0:
        return losses
    size = logits.element_size()
    align = 16 // size if ON_GPU else 1  # the interpreter reads NumPy: no groups there
    aligned, write_grad = rows_aligned(logits, align), grad is not None
    n_values = n_cols if aligned else n_cols + align - 1  # first group to last, at most
    launch = launch or default_launch(n_values, size, write_grad, aligned)
    part = min(launch.part, triton.next_power_of_2(n_values))
    n_parts = triton.cdiv(n_values, part)
    parts_pow2 = triton.next_power_of_2(n_parts)
    stats = counters = losses  # unused by a row in one program
    if n_parts > 1:
        stats = torch.empty(n_rows, 3, parts_pow2, device=logits.device)
        counters = torch.zeros(n_rows, device=logits.device, dtype=torch.int32)
    in_place = grad is logits
    if in_place and n_parts > 1 and not ON_GPU:
        # The interpreter runs a grid's programs one at a time: none can wait for a sibling
        # yet to run, and its way out would read parts the siblings before it have already
        # overwritten. So the gradient goes to a buffer of its own, then over the logits.
        grad = empty_rows_like(logits)
    has_scale = scale is not None
    scale = scale if has_scale else losses
    with quiet():
        cross_entropy_kernel[(n_rows * n_parts,)](
            logits,
            target,
            logits if grad is None else grad,
            losses,
            scale,
            stats,
            counters,
            n_cols,
            n_parts,
            logits.stride(0),
            scale.stride(0) if scale.dim() else 0,
            options.ignore_index,
            options.smoothing,
            PART=part,
            PARTS_POW2=parts_pow2,
            SMOOTH=options.smoothing > 0,
            WRITE_GRAD=write_grad,
            HAS_SCALE=has_scale,
            ALIGN=align,
            ALIGNED=aligned,
            MAX_POLLS=WAIT if grad is logits else MAX_POLLS,
            num_warps=launch.num_warps,
            maxnreg=launch.max_registers,
            **ASSERTS,
        )
    if in_place and grad is not logits:
        logits.copy_(grad)
    return losses


def scale_unless_one(tensor, factor):
    """``tensor *= factor`` in place; skipped on the GPU (no synchronization) if 1."""
    flat = tensor  # a gradient laid out as strided logits: with the gaps nobody reads
    if not tensor.is_contiguous():
        if tensor.stride(-1) != 1:  # not rows with gaps between them: torch's multiply
            return tensor.mul_(factor)
        span = tensor.stride(0) * (len(tensor) - 1) + tensor.shape[1]
        flat = tensor.as_strided((span,), (1,))
    if flat.numel():
        grid = (
            min(
                triton.cdiv(flat.numel(), SCALE_BLOCK),
                SCALE_PROGRAMS_PER_SM * sm_count(),
            ),
        )
        scale_unless_one_kernel[grid](flat, factor, flat.numel(), BLOCK=SCALE_BLOCK)
    return tensor


def kept_rows(target, options):
    """The rows not ignored, which "mean" divides by; None for the other reductions."""
    if options.reduction == "mean":
        # in int64: an int32 target against an ignore_index past int32 would wrap it
        return target.long().ne(options.ignore_index).sum(dtype=torch.float32)


def reduce_losses(losses, count, reduction):
    total = losses if reduction == "none" else losses.sum()
    return total / count if reduction == "mean" else total


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, options):
        count = kept_rows(target, options)
        grad = None if options.reduction == "none" else empty_rows_like(logits)
        scale = None if count is None else count.reciprocal()
        losses = loss_rows(logits, target, options, grad, scale)
        ctx.save_for_backward(logits, target, count)
        ctx.options, ctx.grad = options, grad
        return reduce_losses(losses, count, options.reduction).to(loss_dtype(logits))

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("cross_entropy", "torch.nn.functional.cross_entropy")
        if ctx.grad is not None:  # computed in the forward: hand it over, once
            grad, ctx.grad = ctx.grad, None
            return scale_unless_one(grad, grad_loss), None, None
        logits, target, count = ctx.saved_tensors
        scale = grad_loss if count is None else grad_loss / count
        grad = empty_rows_like(logits)
        loss_rows(logits, target, ctx.options, grad, scale.float())
        return grad, None, None


def check_target(target, shape, ignore_index, label_smoothing, reduction) -> Options:
    checked = cross_entropy_arguments(
        target, *shape, ignore_index, label_smoothing, reduction, REDUCTIONS
    )
    return Options(*checked, reduction)


def cross_entropy(
    logits, target, *, ignore_index=-100, label_smoothing=0.0, reduction="mean"
):
    """``torch.nn.functional.cross_entropy`` for (tokens, vocabulary) logits in fp32, fp16 or
    bf16 and integer targets, computed in fp32, with autograd; no class weights (options by
    keyword). A target outside [0, V), not ``ignore_index``: a ValueError for CPU tensors; on
    a GPU a device-side assert, as PyTorch's, after which CUDA fails in this process."""
    check_tensor(logits, "logits", FLOAT_DTYPES)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"logits must be (tokens, vocabulary >= 1), got {tuple(logits.shape)}: "
            "flatten with logits.reshape(-1, logits.shape[-1]) ((N, C, d1, ...): "
            "move C last first)"
        )
    options = check_target(
        target, logits.shape, ignore_index, label_smoothing, reduction
    )
    logits, target = as_rows(logits), target.contiguous()
    if logits.stride(0) < logits.shape[1]:  # rows share memory: so would the gradient's
        logits = logits.contiguous()
    if logits.requires_grad and torch.is_grad_enabled():
        return CrossEntropyFunction.apply(logits, target, options)
    losses, count = loss_rows(logits, target, options), kept_rows(target, options)
    return reduce_losses(losses, count, reduction).to(loss_dtype(logits))
