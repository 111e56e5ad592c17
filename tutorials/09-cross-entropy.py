r"""
Cross-entropy for large vocabularies
====================================

We write the language-model loss as one kernel that reads the logits once and writes their
gradient in the same launch, then a linear layer + loss that never holds the logits at all.

What you will learn:

* what PyTorch's loss moves and keeps, against the minimum: one read, one write, one buffer;
* the loss and its gradient from one log-sum-exp, with label smoothing and ignored tokens
  folded into a *target distribution* q;
* a row held in the registers of several programs that wait for one another, and a forward
  that waits for nobody: the last program to arrive finishes the row;
* 16-byte loads and stores for rows off the 16-byte grid (V = 50,257);
* a gradient computed in the forward pass and handed to autograd, never overwriting a
  tensor that someone still needs.

Prerequisites: chapter 02 (the online softmax, programs that wait for each other),
chapter 05 (autograd).
"""

# %%
# Setup
# -----

from stepkernels.lessons import bench, check_cross_entropy, tutorial
import torch

tutorial.announce()
DEVICE = tutorial.DEVICE

# %%
# What the loss costs
# -------------------
# A language model ends with logits X, one row of V scores per token, and a target class t per
# row. The loss of a row is -log softmax(x)_t = lse(x) - x_t, with lse the log-sum-exp
# log sum_j exp(x_j); the gradient of a row is softmax(x) minus the one-hot row of t.
#
# ``F.cross_entropy`` runs ``log_softmax`` (read X, write a logits-sized Y, kept for the
# backward) and ``nll_loss``. Its backward writes the gradient of Y, zeros but one value per
# row, then ``log_softmax``'s backward reads Y and that gradient and writes dX. Six passes
# over logits-sized tensors and three such buffers; the minimum is two passes, read X and
# write dX, and dX is the only buffer.

for vocabulary in (32_768, 50_257, 128_256):
    gib = 8192 * vocabulary * 2 / 2**30  # bf16
    print(
        f"8,192 x {vocabulary:,} bf16 logits: {gib:.2f} GiB; torch keeps {3 * gib:.2f}"
    )

# %%
# Training scripts often upcast first, ``F.cross_entropy(logits.float(), t)``, which adds an
# fp32 copy of X and doubles every later buffer. Two passes instead of six: about 3x over
# eager PyTorch, with a third of its memory.
#
# The loss and its gradient, from one log-sum-exp
# -----------------------------------------------
# Two options change the formula. **Label smoothing** ε mixes the one-hot target with a uniform
# one: the target distribution becomes q_j = (1 - ε) [j = t] + ε / V. **Ignored tokens** (target
# equal to ``ignore_index``, padding say) count nothing. For the other rows:
#
#     loss = lse(x) - sum_j q_j x_j = lse(x) - (1 - ε) x_t - ε/V sum_j x_j,
#     d loss / d x_j = softmax(x)_j - q_j.
#
# ``reduction="mean"`` divides by the number of rows not ignored, n, and so does the gradient.
# All the gradient needs (lse, t, ε, n) is known in the forward, except ``grad_loss``, the
# gradient from above, and in training that is 1: ``loss.backward()`` starts there. So the
# forward can write dX = (softmax - q) / n while it holds the row.
#
# A row in registers, over several programs
# -----------------------------------------
# Reading X once means holding each row on chip from its read until its lse is known and its
# gradient written. A row of 128K bf16 values is 256 KB, an SM's whole register file, so we
# split it as chapter 02 does: each of the row's ``n_parts`` programs loads ``PART`` values
# into registers, reduces them to a maximum m_p, a sum s_p of exp(x - m_p) and (for
# smoothing) a sum of x, and publishes the three. What follows depends on what is asked:
#
# * **With the gradient**, every program needs the row's lse: it counts itself in on the row's
#   counter and polls until all have (``arrive_and_wait``, a round trip fewer than chapter
#   02's). Each combines the triples into lse, turns the exp(x - m_p) it kept into
#   softmax(x) = exp(x - m_p) exp(m_p - lse) and writes its part of dX. A row that fits one
#   program skips all of this.
# * **The loss alone** needs one program per row to finish. The counter's old value tells each
#   program when it arrived; the last combines the triples and writes the loss. Nobody waits.
#
# Waiting needs the siblings running: programs start in the order of their ids, so a row's
# parts, numbered next to each other, run together. Like chapter 02 we read the row ourselves
# after ``MAX_POLLS`` tries, unless the gradient overwrites the logits (chapter 10), where a
# sibling may have written its part; x_t is read first for that reason. The interpreter runs
# programs one at a time, so none can wait there: a row in parts writes its gradient to a
# buffer of its own, then over the logits. A target outside [0, V), not ``ignore_index``,
# stops the kernel at a ``tl.device_assert`` (compiled in by ``debug=True``), as PyTorch's loss
# stops at its own: a check on the host would wait for the GPU.
#
# **Rows off the 16-byte grid.** With V = 50,257 in bf16, row r starts 100,514 r bytes in, on
# a 16-byte boundary for one row in eight. Triton vectorizes an access only where it can prove
# 16 bytes aligned and the mask constant over each 16-byte *group*: with an odd V, every
# access of a row read from its start is 2 bytes wide. So we read a row from the group
# boundary before it
# (``row_span``): ``lead`` values of the previous row open the first group, the next row's
# close the last. Reading them is harmless (a group never crosses a page); they become -inf in
# the two parts that hold them. Writing them is not: the parts between store whole groups
# unmasked, the end parts their whole groups, and part 0 the row's values in the shared two.

# @save ops/cross_entropy
from dataclasses import dataclass
import functools

from stepkernels.runtime.arguments import classes_in_range, cross_entropy_arguments
from stepkernels.runtime.core import (
    FLOAT_DTYPES,
    ON_GPU,
    check_tensor,
    loss_dtype,
    refuse_double_backward,
    sm_count,
)
from stepkernels.runtime.launch import (  # cheap repeated launches: chapter 08
    bound_launches,
    cdiv,
    layout,
    lean,
    lean_now,
    next_power_of_2,
    plan_cache,
    recorded_launches,
)
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


# %%
# The backward, the launch and the autograd function
# --------------------------------------------------
# When ``grad_loss`` is 1, the gradient the forward wrote is the answer. Checking that on the
# CPU would cost a synchronization and break a CUDA graph (chapter 08), so a tiny kernel checks
# it on the GPU, returning at once when it is 1, else scaling the gradient in place. The
# count of rows kept, which "mean" divides by, and the reduction are tiny kernels too: one
# program counts the rows and writes 1 / count before the loss kernel scales each row's
# gradient by it, and one adds the rows' losses in a fixed order after it and writes the
# mean in the loss's dtype. Two launches in place of five small torch operations, each a trip
# through torch's dispatcher on the CPU; a repeated call replays all its launches bound
# (chapter 08).
# ``reduction="none"`` (a ``grad_loss`` per row) and a second backward (``retain_graph=True``)
# run the loss kernel again with a scale per row: one read and one write, as before.
#
# The gradient buffer is new, never X (the caller or autograd may still need X), with X's
# strides and 16-byte phase, so that their rows share groups. Launch rules: the fastest of a
# sweep on the H100 over values a program, warps and register caps. Offsets are 64-bit.

# @save ops/cross_entropy
SCALE_BLOCK, SCALE_PROGRAMS_PER_SM = 4096, 4
REDUCE_BLOCK = 1024  # targets or losses a step of the one program that reduces them
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


@triton.jit
def kept_count(target_ptr, n_rows, ignore_index, BLOCK: tl.constexpr):
    """The rows whose target is not ``ignore_index``, as fp32."""
    kept = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        target = tl.load(target_ptr + rows, rows < n_rows, 0).to(tl.int64)
        kept += ((target != ignore_index) & (rows < n_rows)).to(tl.int32)
    return tl.sum(kept, axis=0).to(tl.float32)


@lean
@triton.jit
def mean_scale_kernel(target_ptr, scale_ptr, n_rows, ignore_index, BLOCK: tl.constexpr):
    tl.store(scale_ptr, 1.0 / kept_count(target_ptr, n_rows, ignore_index, BLOCK))


@lean
@triton.jit
def reduce_losses_kernel(
    losses_ptr,
    target_ptr,
    loss_ptr,
    n_rows,
    ignore_index,
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        total += tl.load(losses_ptr + rows, rows < n_rows, 0.0)
    loss = tl.sum(total, axis=0)
    if MEAN:
        loss = loss / kept_count(target_ptr, n_rows, ignore_index, BLOCK)
    tl.store(loss_ptr, loss.to(loss_ptr.dtype.element_ty))


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


# A repeated call of the functions below launches its kernel bound (chapter 08), under a
# key of the tensors' layouts and the options: for the loss kernel, where a row fits one
# program (no partial sums to allocate).
ROWS_PLANS, MEAN_PLANS, REDUCE_PLANS = plan_cache(), plan_cache(), plan_cache()
TENSOR_OR_NONE = (torch.Tensor, type(None))


def loss_rows(logits, target, options, grad=None, scale=None, launch=None):
    """The loss of each row, fp32. Writes the gradient into ``grad`` if given (laid out
    as ``logits``, or ``logits`` itself: in place), times ``scale``: one value or one
    per row."""
    fast = launch is None and type(logits) is torch.Tensor
    fast = fast and type(target) is torch.Tensor and type(grad) in TENSOR_OR_NONE
    fast = fast and type(scale) in TENSOR_OR_NONE and lean_now()
    if fast:
        in_place = grad is logits
        key = (layout(logits), layout(target), options, in_place)
        key = (*key, None if in_place else layout(grad), layout(scale))
        planned = ROWS_PLANS.get(key)
        if planned is not None:
            return planned(logits, target, grad, scale)
    with recorded_launches(fast) as launches:
        losses = launch_loss_rows(logits, target, options, grad, scale, launch)
    if fast:
        written, per_row = logits if grad is None else grad, scale
        rows = (logits, target, written, losses, losses if per_row is None else per_row)
        if bound := bound_launches(launches, (*rows, losses, losses)):
            ROWS_PLANS[key] = planned_rows(bound[0])
    return losses


def planned_rows(launch):
    """``loss_rows`` for one key, its launch bound."""

    def loss_rows_bound(logits, target, grad, scale):
        losses = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
        written = logits if grad is None else grad
        per_row = losses if scale is None else scale
        launch(logits, target, written, losses, per_row, losses, losses)
        return losses

    return loss_rows_bound


def launch_loss_rows(logits, target, options, grad, scale, launch):
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    if n_rows == 0:
        return losses
    size = logits.element_size()
    align = 16 // size if ON_GPU else 1  # the interpreter reads NumPy: no groups there
    aligned, write_grad = rows_aligned(logits, align), grad is not None
    n_values = n_cols if aligned else n_cols + align - 1  # first group to last, at most
    launch = launch or default_launch(n_values, size, write_grad, aligned)
    part = min(launch.part, next_power_of_2(n_values))
    n_parts = cdiv(n_values, part)
    parts_pow2 = next_power_of_2(n_parts)
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


SCALE_PLANS = plan_cache()  # scale_unless_one's launches bound, as the loss's (below)


def scale_unless_one(tensor, factor):
    """``tensor *= factor`` in place; skipped on the GPU (no synchronization) if 1. A
    repeated call launches its kernel bound, under a key of the tensors' layouts."""
    fast = type(tensor) is torch.Tensor and type(factor) is torch.Tensor and lean_now()
    if fast:
        key = (layout(tensor), layout(factor))
        launch = SCALE_PLANS.get(key)
        if launch is not None:  # the kernel reads the address alone: flat or not
            launch(tensor, factor)
            return tensor
    with recorded_launches(fast) as launches:
        scale_in_place(tensor, factor)
    if fast and (bound := bound_launches(launches, (tensor, factor))):
        SCALE_PLANS[key] = bound[0]
    return tensor


def scale_in_place(tensor, factor):
    flat = tensor  # a gradient laid out as strided logits: with the gaps nobody reads
    if not tensor.is_contiguous():
        if tensor.stride(-1) != 1:  # not rows with gaps between them: torch's multiply
            return tensor.mul_(factor)
        span = tensor.stride(0) * (len(tensor) - 1) + tensor.shape[1]
        flat = tensor.as_strided((span,), (1,))
    if flat.numel():
        grid = (
            min(
                cdiv(flat.numel(), SCALE_BLOCK),
                SCALE_PROGRAMS_PER_SM * sm_count(),
            ),
        )
        scale_unless_one_kernel[grid](flat, factor, flat.numel(), BLOCK=SCALE_BLOCK)
    return tensor


def mean_scale(target, options):
    """For "mean", 1 / the rows not ignored, fp32, from one program (no torch operations
    beside the loss kernel); None for the other reductions."""
    if options.reduction != "mean":
        return None
    n_rows, ignore = target.shape[0], options.ignore_index
    fast = type(target) is torch.Tensor and lean_now()
    if fast:
        key = (layout(target), ignore)
        planned = MEAN_PLANS.get(key)
        if planned is not None:
            scale = torch.empty((), device=target.device, dtype=torch.float32)
            planned(target, scale)
            return scale
    scale = torch.empty((), device=target.device, dtype=torch.float32)
    with quiet(), recorded_launches(fast) as launches:  # none kept: 1 / 0, as torch's
        mean_scale_kernel[(1,)](target, scale, n_rows, ignore, BLOCK=REDUCE_BLOCK)
    if fast and (bound := bound_launches(launches, (target, scale))):
        MEAN_PLANS[key] = bound[0]
    return scale


def reduced_loss(losses, target, options, dtype):
    """The losses of the rows reduced as ``options`` say, in ``dtype``: "mean" and "sum"
    by one program that adds the rows in a fixed order (and counts those kept)."""
    if options.reduction == "none":
        return losses.to(dtype)
    fast = type(losses) is torch.Tensor and type(target) is torch.Tensor and lean_now()
    if fast:
        key = (layout(losses), layout(target), options, dtype)
        planned = REDUCE_PLANS.get(key)
        if planned is not None:
            loss = torch.empty((), device=losses.device, dtype=dtype)
            planned(losses, target, loss)
            return loss
    loss = torch.empty((), device=losses.device, dtype=dtype)
    mean = options.reduction == "mean"
    with quiet(), recorded_launches(fast) as launches:  # none kept: 0 / 0, as torch's
        reduce_losses_kernel[(1,)](
            losses,
            target,
            loss,
            losses.shape[0],
            options.ignore_index,
            MEAN=mean,
            BLOCK=REDUCE_BLOCK,
        )
    if fast and (bound := bound_launches(launches, (losses, target, loss))):
        REDUCE_PLANS[key] = bound[0]
    return loss


def loss_and_grad(logits, target, options, with_grad):
    """The loss, and with ``with_grad`` (reduced only) its gradient, written by the loss
    kernel times "mean"'s scale; then that scale and the rows' losses."""
    scale = mean_scale(target, options) if with_grad else None
    grad = empty_rows_like(logits) if with_grad else None
    losses = loss_rows(logits, target, options, grad, scale)
    loss = reduced_loss(losses, target, options, loss_dtype(logits))
    return loss, grad, scale, losses


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, options, planned=None):
        with_grad = options.reduction != "none"
        loss, grad, scale, _ = (planned or loss_and_grad)(
            logits, target, options, with_grad
        )
        ctx.save_for_backward(logits, target, scale)
        ctx.options, ctx.grad = options, grad
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("cross_entropy", "torch.nn.functional.cross_entropy")
        if ctx.grad is not None:  # computed in the forward: hand it over, once
            grad, ctx.grad = ctx.grad, None
            return scale_unless_one(grad, grad_loss), None, None, None
        logits, target, scale = ctx.saved_tensors
        scale = grad_loss if scale is None else grad_loss * scale
        grad = empty_rows_like(logits)
        loss_rows(logits, target, ctx.options, grad, scale.float())
        return grad, None, None, None


def check_target(target, shape, ignore_index, label_smoothing, reduction) -> Options:
    checked = cross_entropy_arguments(
        target, *shape, ignore_index, label_smoothing, reduction, REDUCTIONS
    )
    return Options(*checked, reduction)


# A repeated call launches its kernels bound (chapter 08), under a key of all that the first
# call checked and its launches read: the logits' and the target's shapes, strides, dtypes,
# device and alignment, the options, whether a gradient is wanted, and the loss's dtype.
LOSS_PLANS = plan_cache()


def planned_loss(bound, options, with_grad, dtype):
    """``loss_and_grad`` for one key, its launches bound: what it allocates, then them."""
    scaled = with_grad and options.reduction == "mean"
    launch_scale = bound[0] if scaled else None
    launch_rows, *launch_reduce = bound[1:] if scaled else bound

    loss_rows_bound = planned_rows(launch_rows)

    def loss_and_grad_bound(logits, target, *_):
        device, scale = logits.device, None
        if scaled:
            scale = torch.empty((), device=device, dtype=torch.float32)
            launch_scale(target, scale)
        grad = empty_rows_like(logits) if with_grad else None
        losses = loss_rows_bound(logits, target, grad, scale)
        if not launch_reduce:  # reduction "none"
            return losses.to(dtype), grad, scale, losses
        loss = torch.empty((), device=device, dtype=dtype)
        launch_reduce[0](losses, target, loss)
        return loss, grad, scale, losses

    loss_and_grad_bound.options = options
    return loss_and_grad_bound


def plan_loss(key, launches, logits, target, options, results, with_grad, dtype):
    """Keep the call's launches bound under ``key`` if they took ``logits`` and ``target``
    as they came (no copy) and a row in one program (no partial sums to allocate)."""
    loss, grad, scale, losses = results
    rows = (logits, target, logits if grad is None else grad, losses)
    rows = (*rows, losses if scale is None else scale, losses, losses)
    expected = [rows]
    if scale is not None:
        expected.insert(0, (target, scale))
    if options.reduction != "none":
        expected.append((losses, target, loss))
    bound = bound_launches(launches, *expected)
    if bound is not None:
        LOSS_PLANS[key] = planned_loss(bound, options, with_grad, dtype)


def cross_entropy(
    logits, target, *, ignore_index=-100, label_smoothing=0.0, reduction="mean"
):
    """``torch.nn.functional.cross_entropy`` for (tokens, vocabulary) logits in fp32, fp16 or
    bf16 and integer targets, computed in fp32, with autograd; no class weights (options by
    keyword). A target outside [0, V), not ``ignore_index``: a ValueError for CPU tensors; on
    a GPU a device-side assert, as PyTorch's, after which CUDA fails in this process."""
    fast = type(logits) is torch.Tensor and type(target) is torch.Tensor
    fast = fast and type(ignore_index) is int and type(reduction) is str
    fast = fast and type(label_smoothing) in (int, float)
    fast = fast and not torch.compiler.is_compiling() and lean_now()
    if fast:  # a call seen before: checked then, its launches bound
        want_grad = logits.requires_grad and torch.is_grad_enabled()
        dtype = loss_dtype(logits)
        key = (layout(logits), layout(target), ignore_index, label_smoothing)
        key = (*key, reduction, want_grad, dtype)
        planned = LOSS_PLANS.get(key)
        if planned is not None:
            classes_in_range(target, logits.shape[1], "target", ignore_index)  # CPU's
            if want_grad:
                return CrossEntropyFunction.apply(
                    logits, target, planned.options, planned
                )
            return planned(logits, target)[0]
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
    given = logits, target
    logits, target = as_rows(logits), target.contiguous()
    if logits.stride(0) < logits.shape[1]:  # rows share memory: so would the gradient's
        logits = logits.contiguous()
    if torch.compiler.is_compiling():  # an operator the compiler calls (below)
        want_grad = logits.requires_grad and torch.is_grad_enabled()
        chosen = (options.ignore_index, options.smoothing, reduction, want_grad)
        return cross_entropy_op(logits, target, *chosen)[0]
    want_grad = logits.requires_grad and torch.is_grad_enabled()
    results = []  # what loss_and_grad made, to bind the launches to

    def recorded(*args):
        results.append(loss_and_grad(*args))
        return results[-1]

    with recorded_launches(fast) as launches:
        if want_grad:
            loss = CrossEntropyFunction.apply(logits, target, options, recorded)
        else:
            loss = recorded(logits, target, options, False)[0]
    if fast:
        with_grad = want_grad and reduction != "none"
        args = (launches, *given, options, results[0], with_grad, loss_dtype(logits))
        plan_loss(key, *args)
    return loss


# %%
# ``torch.compile`` sees the loss as an operator of ``torch.library`` (chapter 08). Its
# programs wait on each other for long rows and choose their loads by the logits' address,
# which a traced tensor does not have: so this one is a ``custom_op``, opaque, called by the
# compiled graph as it is. For "mean" and "sum" the forward writes the gradient too, which the
# derivative only scales.

# @save ops/cross_entropy
from torch import Tensor
from torch.library import custom_op


@custom_op("stepkernels::cross_entropy", mutates_args=())
def cross_entropy_op(
    logits: Tensor,
    target: Tensor,
    ignore_index: int,
    smoothing: float,
    reduction: str,
    want_grad: bool,
) -> tuple[Tensor, Tensor]:
    """The loss, and d loss / d logits if ``want_grad`` and reduced, else empty."""
    options = Options(ignore_index, smoothing, reduction)
    with_grad = want_grad and reduction != "none"
    loss, grad, _, _ = loss_and_grad(logits, target, options, with_grad)
    return loss, logits.new_empty(0) if grad is None else grad


@cross_entropy_op.register_fake
def _(logits, target, ignore_index, smoothing, reduction, want_grad):
    shape = (logits.shape[0],) if reduction == "none" else ()
    loss = logits.new_empty(shape, dtype=loss_dtype(logits))
    with_grad = want_grad and reduction != "none"
    grad = logits.new_empty_strided(logits.shape, logits.stride())
    return loss, grad if with_grad else logits.new_empty(0)


@custom_op("stepkernels::cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(
    logits: Tensor, target: Tensor, scale: Tensor, ignore_index: int, smoothing: float
) -> Tensor:
    """d loss / d logits times ``scale``, one value a row (reduction "none")."""
    grad = empty_rows_like(logits)
    options = Options(ignore_index, smoothing, "none")
    loss_rows(logits, target, options, grad, scale.float())
    return grad


@cross_entropy_backward_op.register_fake
def _(logits, target, scale, ignore_index, smoothing):
    return logits.new_empty_strided(logits.shape, logits.stride())


def cross_entropy_setup(ctx, inputs, output):
    logits, target, ctx.ignore_index, ctx.smoothing, ctx.reduction, _ = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.set_materialize_grads(False)  # the gradient output gets none


def cross_entropy_backward(ctx, grad_loss, _grad_grad):
    refuse_double_backward("cross_entropy", "torch.nn.functional.cross_entropy")
    logits, target, grad = ctx.saved_tensors
    if ctx.reduction != "none":  # computed in the forward
        return grad * grad_loss, None, None, None, None, None
    rows = (logits, target, grad_loss, ctx.ignore_index, ctx.smoothing)
    return cross_entropy_backward_op(*rows), None, None, None, None, None


cross_entropy_op.register_autograd(
    cross_entropy_backward, setup_context=cross_entropy_setup
)


# %%
# Correctness
# -----------
# ``check_cross_entropy.check`` compares loss and gradient with ``F.cross_entropy`` in fp64, within
# a rounding of the dtype: rows of several parts and off the 16-byte grid (a strided slice),
# smoothing with ignored rows, every reduction, large logits. Then errors that say what to do: a
# target out of range among them on the CPU (on a GPU it stops the kernel, and CUDA with it).


def logits_off_the_grid(n_rows, n_cols, dtype, scale=1.0):
    """A slice of rows of n_cols + 3 values, 3 values in: rows off the 16-byte grid."""
    return (scale * torch.randn(n_rows, n_cols + 3, device=DEVICE)).to(dtype)[:, 3:]


n_rows, n_cols = bench.choose(gpu=(257, 128_256), cpu=(3, 33_001))
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for reduction, smoothing in (("mean", 0.0), ("sum", 0.1), ("none", 0.2)):
        check_cross_entropy.check(
            cross_entropy,
            logits_off_the_grid(n_rows, n_cols, dtype),
            check_cross_entropy.targets(n_rows, n_cols, DEVICE),
            reduction=reduction,
            label_smoothing=smoothing,
        )
large = logits_off_the_grid(5, n_cols, torch.float32, scale=1000.0)
# exp(x - m) starts from x - m in fp32: its error grows with |x|, 2^-23 |x| at most
check_cross_entropy.check(
    cross_entropy,
    large,
    check_cross_entropy.targets(5, n_cols, DEVICE),
    grad_atol=2**-23 * large.abs().max().item(),
)
print(f"cross_entropy matches PyTorch: V = {n_cols:,}, 3 dtypes, 3 reductions")
zeros = lambda *shape, dtype=None: torch.zeros(*shape, device=DEVICE, dtype=dtype)
bad_calls = {
    "float target": lambda: cross_entropy(zeros(2, 5), zeros(2)),
    "3-D logits": lambda: cross_entropy(zeros(2, 3, 5), zeros(2, 3, dtype=torch.long)),
    "wrong target shape": lambda: cross_entropy(
        zeros(2, 5), zeros(3, dtype=torch.long)
    ),
    "int8 logits": lambda: cross_entropy(
        zeros(2, 5, dtype=torch.int8), zeros(2).long()
    ),
    "reduction": lambda: cross_entropy(zeros(2, 5), zeros(2).long(), reduction="avg"),
}
if not tutorial.ON_GPU:
    bad_calls["target 7 of 5"] = lambda: cross_entropy(zeros(2, 5), zeros(2).long() + 7)
tutorial.show_refusals("cross_entropy()", bad_calls)

# %%
# Benchmarks
# ----------
# 8,192 tokens, vocabularies from 16,384 to 131,072 (GPT-2's 50,257 among them), bf16 and
# fp32, forward alone and forward + backward, against eager PyTorch, ``torch.compile`` and
# Liger-Kernel's loss, which writes the gradient into the logits themselves. We count the
# compulsory bytes: the logits read once, plus the gradient written once with the backward.
# Solid lines are GPU time (CUDA-graph replays), dotted ones the call from Python. Liger's
# backward asks the CPU whether ``grad_loss`` is 1, which a graph cannot capture: its value is
# the call. The limit is a copy of the same bytes. A third benchmark records peak memory.

try:  # Liger-Kernel, where installed
    from liger_kernel.transformers import LigerCrossEntropyLoss
except ImportError:
    LigerCrossEntropyLoss = None
PEERS = ["torch", "torch.compile"] + (["liger_kernel"] if LigerCrossEntropyLoss else [])
TOKENS = bench.choose(gpu=8192, cpu=16)
VOCABULARIES = [16_384, 32_768, 50_257, 65_536, 131_072]
# Recorded for comparison: a program a row, the gradient from a second pass over the row
TWO_PASSES = "cross-entropy-forward-backward-two-passes"


def make_loss_call(provider, n_cols, dtype, backward=True):
    logits = torch.randn(TOKENS, n_cols, device=DEVICE, dtype=dtype)
    target = torch.randint(0, n_cols, (TOKENS,), device=DEVICE)
    loss = cross_entropy if provider == "triton" else torch.nn.functional.cross_entropy
    loss = bench.compile_static(loss) if provider == "torch.compile" else loss
    loss = LigerCrossEntropyLoss() if provider == "liger_kernel" else loss
    logits.requires_grad_(backward)
    if not backward:
        return lambda: loss(logits, target)
    return lambda: torch.autograd.grad(loss(logits, target), logits)


def loss_benchmark(name, backward, unit="GB/s"):
    passes = 2 if backward else 1
    copy = [bench.COPY_PROVIDER] if unit == "GB/s" else []
    return bench.Benchmark(
        name=name,
        x_name="V (vocabulary), 8,192 tokens",
        x_values=VOCABULARIES,  # on a GPU
        providers=["triton", *PEERS, *copy],
        make=lambda p, n, dtype: make_loss_call(p, n, dtype, backward),
        work=lambda n, dtype: passes * TOKENS * n * dtype.itemsize,
        unit=unit,
        dtypes=(torch.bfloat16,) if unit != "GB/s" else (torch.bfloat16, torch.float32),
        smoke_x=1000,
        headline_x=131_072,
        uncapturable=("liger_kernel",),
    )


loss_results = {}
for name, backward, unit in (
    ("cross-entropy-forward", False, "GB/s"),
    ("cross-entropy-forward-backward", True, "GB/s"),
    ("cross-entropy-memory", True, bench.MEMORY_UNIT),
):
    loss_results[name] = bench.run(loss_benchmark(name, backward, unit))


shown = [(name, loss_results[name]) for name in list(loss_results)[:2]]
if first := bench.load_recorded(TWO_PASSES):
    old = bench.Results(loss_benchmark(TWO_PASSES, True), *first, live=False)
    shown.append(("two passes over each row, forward-backward", old))
for name, results in shown:
    if results:
        lines = results.standing("triton", bench.COPY_PROVIDER)
        print(f"{name}, against every peer and a copy, {results.how}:")
        print("  " + "\n  ".join(lines))
if both := loss_results["cross-entropy-forward-backward"]:
    for x in (16_384, 32_768):
        print(both.as_called("triton", "torch", x, "bfloat16"))
if memory := loss_results["cross-entropy-memory"]:
    at = lambda p: f"{p} {memory.value(p, 131_072, 'bfloat16'):.2f}"
    print("Beyond the inputs, V = 131,072 bf16, GiB:", *map(at, memory.providers()))

# %%
# Holding the row pays most in bf16: read twice (a program per row, the gradient from a second
# pass that hopes to find the row in L2), the forward-backward reaches half the copy at best
# (the "two passes" lines). The loss alone reads the logits once and waits for nobody. With
# the gradient, rows that fit one program come closest to the copy; rows of several parts lose
# to waiting, bf16 most (its parts hold half the bytes for the same wait). GPU time counts the
# whole call, the small launches around our kernel too. Called from Python, a repeated call
# costs the CPU its bound launches and allocations (chapter 08 compares it with torch's).
# Memory: one logits-sized buffer, as ``torch.compile``; Liger-Kernel
# overwrites the caller's logits.
#
# What we learned
# ---------------
# * Loss = lse - q·x and gradient = softmax - q: smoothing and ignored rows cost nothing.
# * A row too long for one program stays on chip in several, which publish partial sums and
#   wait for each other when all need the total (when one does, the last to arrive).
# * Accesses are 16 bytes wide only where the compiler can prove it: read rows off the grid
#   from the group before them, and keep the stores off the neighbours' values.
# * Autograd owns what we return: hand a buffer over once, recompute for a second backward.
#
# The sweep behind the launch rules is ``lab/cross_entropy_parts.py``; ``lab/NOTES.md`` has
# the rest of the measurements behind this chapter.
#
# Exercises
# ---------
# 1. Add ``z_loss`` (PaLM's lse² penalty): what changes in the loss and in the gradient?
# 2. Keep x in registers in bf16, not exp(x - m) in fp32, and exponentiate twice: faster?
# 3. Give chapter 02's split softmax our ``arrive_and_wait``, and time the long rows again.
