r"""
Fused softmax: one pass over memory, for rows of any length
===========================================================

We write softmax and log-softmax over the last dimension, forward and backward, as Triton
kernels that read each input once and write each output once, for rows of 256 elements and
of 262,144. We learn why fusion cuts softmax's traffic by four; row reductions
(``tl.max``, ``tl.sum``) over tiles of several rows; the *online* softmax for rows too long
for one block, and a split-row kernel whose programs wait for one another (release and
acquire atomics); and the backward, wrapped in ``torch.autograd.Function``.

Prerequisites: chapter 01 (programs, blocks, masks, the wrapper and the benchmark).
"""

# %%
# Setup
# -----

import itertools

from stepkernels.lessons import bench, tutorial
import torch

tutorial.announce()
DEVICE = tutorial.DEVICE

# %%
# Softmax in PyTorch operations, and what it costs
# ------------------------------------------------
# For a row x of N numbers, softmax(x)_i = exp(x_i) / sum_j exp(x_j). exp overflows for
# x_i above about 88 in fp32, so every implementation first subtracts the row's maximum.
# In PyTorch operations, for an M x N matrix:


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension in five PyTorch operations (our baseline)."""
    row_max = x.max(dim=-1, keepdim=True).values  # read M*N, write M
    shifted = x - row_max  # read M*N + M, write M*N
    numerator = torch.exp(shifted)  # read M*N, write M*N
    denominator = numerator.sum(dim=-1, keepdim=True)  # read M*N, write M
    return numerator / denominator  # read M*N + M, write M*N


# %%
# Each operation is a kernel that reads its inputs from memory and writes its result back: 8 M N
# elements moved where 2 M N suffice (read x once, write y once). With about five operations per
# element against an H100's 60 fp32 TFLOP/s and 3 TB/s, the time is the bytes: a *fused* kernel,
# keeping a row on chip from load to store, should be up to 4x faster (2 M N x bytes per element).
#
# The fused kernel
# ----------------
# A program handles a tile of ``ROWS`` rows by ``BLOCK_N`` columns, the row length rounded up
# to a power of two. Out-of-row lanes load ``-inf``: they never win the maximum and their exp
# is 0. ``tl.max`` and ``tl.sum`` with ``axis=1`` reduce each row of the tile. We compute in
# fp32 and round once at the store. With ``LOG`` (a compile-time switch) the kernel returns
# log-softmax, (x_i - max) - log(sum); a row of only ``-inf`` gives NaN, as in PyTorch. Cells
# marked ``# @save ops/softmax`` are the package's ``stepkernels.ops.softmax`` (chapter 01 says
# how).

# @save ops/softmax
from dataclasses import dataclass
import functools

from stepkernels.runtime.arguments import softmax_arguments
from stepkernels.runtime.core import refuse_double_backward
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
from stepkernels.runtime.waiting import MAX_POLLS, publish_and_wait
import torch
import triton
import triton.language as tl


@lean
@triton.jit
def softmax_kernel(
    x_ptr,
    y_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    y_row_stride,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)[None, :]
    in_bounds = (rows < n_rows)[:, None] & (cols < n_cols)
    rows = rows.to(tl.int64)[:, None]  # M x N may pass 2**31 elements
    x_ptrs = x_ptr + rows * x_row_stride + cols
    x = tl.load(x_ptrs, mask=in_bounds, other=-float("inf")).to(tl.float32)
    row_max = tl.max(x, axis=1)
    shifted = x - row_max[:, None]
    numerator = tl.exp(shifted)
    denominator = tl.sum(numerator, axis=1)
    if LOG:
        y = shifted - tl.log(denominator)[:, None]
    else:
        y = numerator * (1.0 / denominator)[:, None]
    y_ptrs = y_ptr + rows * y_row_stride + cols
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=in_bounds)


# %%
# Rows too long for one block: the online softmax
# -----------------------------------------------
# A program keeps its tile in registers, 256 KB per H100 SM: a row of 262,144 fp32 values
# cannot fit. It must stream the row in chunks, yet softmax needs the row's maximum and sum
# before it can write anything. The *online softmax* (Milakov and Gimelshein, 2018) finds
# both in one pass: keep a running maximum m and a running sum s of exp(x - m); when a chunk
# raises the maximum to m', rescale: s' = s exp(m - m') + sum exp(x - m'). (While the row
# has shown only -inf we shift by 0, since exp(-inf - (-inf)) is NaN.)
#
# A kernel that streams its row so must read it a second time to write exp(x - m) / s: 3 M N
# elements of traffic instead of 2 M N. The next section removes that second read; the online
# pass stays as its way out, for the rare row whose programs do not all run at once.

# @save ops/softmax


@triton.jit
def online_max_and_sum(x_row, n_cols, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One pass over the ``n_cols`` values at ``x_row`` in chunks of ``BLOCK_N``: the
    row's maximum and its sum of exp(x - maximum), the online softmax's running pair."""
    cols = tl.arange(0, BLOCK_N)
    running_max = -float("inf")
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    for chunk in tl.range(0, tl.cdiv(n_cols, BLOCK_N), num_stages=NUM_STAGES):
        offsets = chunk * BLOCK_N + cols
        x = tl.load(
            x_row + offsets,
            mask=offsets < n_cols,
            other=-float("inf"),
            eviction_policy="evict_last",
        ).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(running_max - shift) + tl.exp(x - shift)
        running_max = new_max
    return running_max, tl.sum(lane_sum, axis=0)


# %%
# Reading a long row once: split it across programs
# -------------------------------------------------
# To read x once from memory, we give each row to several programs, one chunk each. Each reduces
# its chunk to a pair (maximum m_c, sum s_c of exp(x - m_c)) and publishes it; once its row's
# pairs are all there, each combines them into m = max m_c and S = sum s_c exp(m_c - m) and
# writes y. Through the wait an fp32 chunk stays in registers, which measured faster on an
# H100 than reading it again; a 16-bit chunk is loaded ``evict_last`` and read again from L2
# after the wait, which measured at least as fast as holding it.
#
# Publishing: store the pair; ``tl.debug_barrier()``, so that every thread has stored; then
# ``tl.atomic_add`` on the row's counter with ``sem="release"``, which orders the stores
# before the increment for a program that reads the counter with ``sem="acquire"``.
# Waiting: poll the counter until all chunks have counted, then read the pairs with
# ``volatile=True``, so no stale cache line answers. CUDA does not promise that a row's
# programs run at once: after ``MAX_POLLS`` tries a program walks the row itself (online), in
# blocks of 1,024 values (``WAY_OUT_BLOCK``). A kernel gets the registers of its hungriest
# path whether that path runs or not, so a way out in blocks as large as the chunk would leave
# room for fewer programs on an SM. The interpreter runs programs one by one: only a row's last
# chunk finds all pairs.

# @save runtime/waiting
from stepkernels.runtime.core import ON_GPU
import triton
import triton.language as tl

# Split kernels: the tries before a program stops waiting and reads the row itself.
MAX_POLLS = 100_000 if ON_GPU else 2


@triton.jit
def publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS: tl.constexpr):
    """Announce this program's stores to the other programs of its row, then wait (at
    most MAX_POLLS tries) until all ``n_chunks`` have announced theirs. True if they all
    did."""
    publish(counter_ptr, row)
    return wait_for(counter_ptr, row, n_chunks, MAX_POLLS)


@triton.jit
def publish(counter_ptr, row):
    tl.debug_barrier()  # every thread of this program has stored
    tl.atomic_add(counter_ptr + row, 1, sem="release")


@triton.jit
def wait_for(counter_ptr, row, n_chunks, MAX_POLLS: tl.constexpr):
    published = tl.atomic_add(counter_ptr + row, 0, sem="acquire")
    polls = 0
    while (published < n_chunks) & (polls < MAX_POLLS):
        published = tl.atomic_add(counter_ptr + row, 0, sem="acquire")
        polls += 1
    return published >= n_chunks


# %%
# The split kernel: each program reduces its chunk, publishes its pair and waits; the waiting
# helpers above are shared with chapters 09 and 13 (the package keeps them in
# ``stepkernels.runtime.waiting``).

# @save ops/softmax
WAY_OUT_BLOCK = tl.constexpr(1024)  # a global a kernel reads must be a constexpr


@triton.jit
def load_f32(ptrs, mask, other, HINT: tl.constexpr):  # HINT: the L2 eviction policy
    return tl.load(ptrs, mask=mask, other=other, eviction_policy=HINT).to(tl.float32)


@lean
@triton.jit
def softmax_split_kernel(
    x_ptr,
    y_ptr,
    stats_ptr,
    counter_ptr,
    n_cols,
    n_chunks,
    x_row_stride,
    y_row_stride,
    BLOCK_N: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    LOG: tl.constexpr,
    MAX_POLLS: tl.constexpr,
):
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    x_row = x_ptr + row * x_row_stride
    x = load_f32(x_row + cols, in_row, -float("inf"), "evict_last")
    chunk_max = tl.max(x, axis=0)
    chunk_shift = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
    chunk_sum = tl.sum(tl.exp(x - chunk_shift), axis=0)
    # stats holds, per row, CHUNKS_POW2 maxima and then CHUNKS_POW2 sums.
    row_stats = stats_ptr + row * 2 * CHUNKS_POW2
    tl.store(row_stats + chunk, chunk_max)
    tl.store(row_stats + CHUNKS_POW2 + chunk, chunk_sum)
    if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):  # combine the pairs
        chunks = tl.arange(0, CHUNKS_POW2)
        present = chunks < n_chunks
        maxima = tl.load(
            row_stats + chunks, mask=present, other=-float("inf"), volatile=True
        )
        sums = tl.load(row_stats + CHUNKS_POW2 + chunks, mask=present, volatile=True)
        row_max = tl.max(maxima, axis=0)
        row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
        # A chunk of only -inf has sum 0 and weight exp(-inf) = 0: never 0 * overflow.
        weights = tl.exp(maxima - row_shift)
        row_sum = tl.sum(tl.where(present, sums * weights, 0.0))
    else:  # the siblings are not running: read the row ourselves, online
        row_max, row_sum = online_max_and_sum(x_row, n_cols, WAY_OUT_BLOCK, 1)
        row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
    if x_ptr.dtype.element_ty != tl.float32:  # 16-bit x: read again, from L2
        x = load_f32(x_row + cols, in_row, -float("inf"), "evict_first")
    if LOG:
        y = (x - row_max) - tl.log(row_sum)
    else:
        y = tl.exp(x - row_shift) * (1.0 / row_sum)
    y_row = y_ptr + row * y_row_stride
    tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


# %%
# The backward
# ------------
# With y = softmax(x) and dy the incoming gradient, the Jacobian dy_i/dx_j = y_i (delta_ij - y_j)
# collapses to one dot product per row: dx = y * (dy - sum(dy * y)). For log-softmax,
# dy_i/dx_j = delta_ij - softmax(x)_j gives dx = dy - exp(y) * sum(dy). Both are a row reduction
# and an elementwise step on the saved *output* y and dy: 3 M N elements of traffic. A fused
# kernel takes rows of up to half the forward's block (it holds two tensors); longer rows split
# as in the forward, each program publishing its part of the sum. It holds its chunks of y and
# dy through the wait: reading them again from L2, as the 16-bit forward does, measured slower
# in both dtypes.

# @save ops/softmax


@lean
@triton.jit
def softmax_backward_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    n_rows,
    n_cols,
    y_row_stride,
    dy_row_stride,
    dx_row_stride,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)[None, :]
    in_bounds = (rows < n_rows)[:, None] & (cols < n_cols)
    rows = rows.to(tl.int64)[:, None]
    y = load_f32(y_ptr + rows * y_row_stride + cols, in_bounds, 0.0, "")
    dy = load_f32(dy_ptr + rows * dy_row_stride + cols, in_bounds, 0.0, "")
    if LOG:
        dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]
    else:
        dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    dx_ptrs = dx_ptr + rows * dx_row_stride + cols
    tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=in_bounds)


@lean
@triton.jit
def softmax_backward_split_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    partial_ptr,
    counter_ptr,
    n_cols,
    n_chunks,
    y_row_stride,
    dy_row_stride,
    dx_row_stride,
    BLOCK_N: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    LOG: tl.constexpr,
    MAX_POLLS: tl.constexpr,
):
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    y_row, dy_row = y_ptr + row * y_row_stride, dy_ptr + row * dy_row_stride
    y = tl.load(y_row + cols, mask=in_row, other=0.0).to(tl.float32)
    dy = tl.load(dy_row + cols, mask=in_row, other=0.0).to(tl.float32)
    parts = partial_ptr + row * CHUNKS_POW2  # each chunk's part of the row's sum
    if LOG:
        tl.store(parts + chunk, tl.sum(dy, axis=0))
    else:
        tl.store(parts + chunk, tl.sum(dy * y, axis=0))
    if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):
        chunks = tl.arange(0, CHUNKS_POW2)
        present = chunks < n_chunks
        partials = tl.load(parts + chunks, mask=present, other=0.0, volatile=True)
        total = tl.sum(partials, axis=0)
    else:  # the siblings are not running: sum the row ourselves
        lanes = tl.zeros([WAY_OUT_BLOCK], tl.float32)
        for start in range(0, n_cols, WAY_OUT_BLOCK):
            offsets = start + tl.arange(0, WAY_OUT_BLOCK)
            mask = offsets < n_cols
            part = tl.load(dy_row + offsets, mask=mask, other=0.0).to(tl.float32)
            if not LOG:
                part *= tl.load(y_row + offsets, mask=mask, other=0.0).to(tl.float32)
            lanes += part
        total = tl.sum(lanes, axis=0)
    if LOG:
        dx = dy - tl.exp(y) * total
    else:
        dx = y * (dy - total)
    dx_row = dx_ptr + row * dx_row_stride
    tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)


# %%
# Launch rules and wrappers
# -------------------------
# With the bytes fixed, speed comes from the launch. One row of 256 fp32 values over 4 warps
# gives each thread two values, too few loads in flight to hide DRAM's latency, so a tile of
# short rows holds about 4,096 values, with a warp per 1,024; a split program takes a chunk of
# 8,192. These are the best launches of sweeps on an H100. Each fused program takes one tile:
# a persistent grid, pipelining its tiles, measured no faster. The wrappers see rows with
# unit stride: a slice like ``x[:, :N]`` is read in place, a transposed matrix copied, and a
# ``dim`` other than the last (the fastest) moved last, ``x.movedim(dim, -1)``: a copy too.
# The backward refuses ``create_graph=True``: autograd cannot differentiate a Triton kernel.

# @save ops/softmax
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_FUSED_BLOCK = 32768  # longest row kept whole in registers (forward)
MAX_FUSED_BLOCK_BACKWARD = 16384  # the backward holds two tensors, y and dy
TILE_ELEMENTS, ELEMENTS_PER_WARP = 4096, 1024  # short rows: values a tile, a warp
SPLIT_FORWARD, SPLIT_BACKWARD = (8192, 8), (8192, 4)  # split: values a program, warps


@dataclass(frozen=True)
class Launch:
    kernel: str  # "fused" (a tile in registers) or "split" (a program per chunk)
    block_n: int  # columns of a tile: the whole row (fused) or one chunk
    rows: int = 1  # rows of a tile (fused)
    num_warps: int = 4


@functools.cache  # called on every softmax: keep it off the launch's critical path
def default_launch(n_cols: int, backward: bool = False) -> Launch:
    block_n = max(16, triton.next_power_of_2(n_cols))
    if block_n > MAX_FUSED_BLOCK and not backward:
        return Launch("split", SPLIT_FORWARD[0], num_warps=SPLIT_FORWARD[1])
    if block_n > MAX_FUSED_BLOCK_BACKWARD and backward:
        return Launch("split", SPLIT_BACKWARD[0], num_warps=SPLIT_BACKWARD[1])
    rows = max(1, TILE_ELEMENTS // block_n)
    num_warps = min(32, max(4, rows * block_n // ELEMENTS_PER_WARP))
    return Launch("fused", block_n, rows, num_warps)


# %%
# Two helpers every row-wise op of the package uses (``stepkernels.runtime.rows``): a view of
# any tensor as a matrix of rows with unit stride, and silence for NumPy's warnings under the
# interpreter, which computes with NumPy and warns where a GPU silently makes NaN (padding rows
# of a tile, rows of only -inf): the same NaN.

# @save runtime/rows
import contextlib
import functools

import numpy as np
from stepkernels.runtime.core import INTERPRET
import torch

quiet = functools.partial(np.errstate, invalid="ignore", divide="ignore")
quiet = quiet if INTERPRET else contextlib.nullcontext


def as_rows(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2 and t.stride(1) == 1:  # the common case, without reshape's cost
        return t
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# %%
# The launch and the wrappers, the rules above put to work. On the host, ``cdiv`` and
# ``next_power_of_2`` are plain arithmetic from ``stepkernels.runtime.launch``: Triton's own
# cost microseconds a call, and a call of ours runs them every time (chapter 08).


# @save ops/softmax
def launch_rows(tensors: tuple, log: bool, launch: Launch, backward: bool) -> None:
    """Run ``launch`` over matrices of rows: (x, y) forward, (y, dy, dx) backward."""
    n_rows, n_cols = tensors[0].shape
    strides = [t.stride(0) for t in tensors]
    meta = {"BLOCK_N": launch.block_n, "LOG": log, "num_warps": launch.num_warps}
    if launch.kernel == "split":
        n_chunks = cdiv(n_cols, launch.block_n)
        chunks_pow2 = next_power_of_2(n_chunks)
        shape = (n_rows, 1 if backward else 2, chunks_pow2)  # pairs, or sums
        partials = torch.empty(shape, device=tensors[0].device)
        counters = torch.zeros(n_rows, device=partials.device, dtype=torch.int32)
        kernel = softmax_backward_split_kernel if backward else softmax_split_kernel
        kernel[(n_rows * n_chunks,)](
            *tensors,
            partials,
            counters,
            n_cols,
            n_chunks,
            *strides,
            CHUNKS_POW2=chunks_pow2,
            MAX_POLLS=MAX_POLLS,
            **meta,
        )
    elif launch.kernel == "fused" and launch.block_n >= n_cols:
        kernel = softmax_backward_kernel if backward else softmax_kernel
        grid = (cdiv(n_rows, launch.rows),)
        kernel[grid](*tensors, n_rows, n_cols, *strides, ROWS=launch.rows, **meta)
    else:
        raise ValueError(f"{launch} cannot take rows of {n_cols}")


def softmax_forward(x, log: bool = False, launch: Launch | None = None):
    """Softmax (or log-softmax) over the last dimension, without autograd."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() > 0:
        x_rows = as_rows(x)
        launch = launch or default_launch(x.shape[-1])
        with quiet():
            launch_rows((x_rows, y.view(x_rows.shape)), log, launch, backward=False)
    return y


def softmax_backward(y, dy, log: bool = False, launch: Launch | None = None):
    """The gradient with respect to x, given the forward's output y and dy."""
    dx = torch.empty_like(y, memory_format=torch.contiguous_format)
    if y.numel() > 0:
        rows = (as_rows(y), as_rows(dy.to(y.dtype)), as_rows(dx))
        launch = launch or default_launch(y.shape[-1], backward=True)
        with quiet():
            launch_rows(rows, log, launch, backward=True)
    return dx


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, planned=None):
        y = softmax_forward(x, log) if planned is None else planned(x)
        ctx.save_for_backward(y)
        ctx.log = log
        return y

    @staticmethod
    def backward(ctx, dy):
        name = "log_softmax" if ctx.log else "softmax"
        refuse_double_backward(name, f"torch.{name}")
        (y,) = ctx.saved_tensors
        return softmax_backward_planned(y, dy, ctx.log), None, None


# A repeated call launches its kernel bound (chapter 08): under a key of all that the
# launch read from the call, x's shape, strides, dtype, device and alignment.
FORWARD_PLANS, BACKWARD_PLANS = plan_cache(), plan_cache()


def planned_forward(launch):
    def forward(x):
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        launch(x, y)
        return y

    return forward


def softmax_backward_planned(y, dy, log):
    """``softmax_backward``, bound after its first call with dy's layout."""
    fast = type(dy) is torch.Tensor and lean_now()
    if fast:
        key = (layout(y), layout(dy), log)
        launch = BACKWARD_PLANS.get(key)
        if launch is not None:
            dx = torch.empty_like(y, memory_format=torch.contiguous_format)
            launch(y, dy, dx)
            return dx
    with recorded_launches(fast) as launches:
        dx = softmax_backward(y, dy, log)
    if fast and (bound := bound_launches(launches, (y, dy, dx))):
        BACKWARD_PLANS[key] = bound[0]
    return dx


def softmax(x: torch.Tensor, dim: int = -1, *, log: bool = False) -> torch.Tensor:
    """``torch.softmax(x, dim)`` (``log=True``: ``log_softmax``) for fp32, fp16 and bf16,
    with autograd; a ``dim`` but the last (the fastest) is moved there, then back."""
    fast = type(x) is torch.Tensor and type(dim) is int and type(log) is bool
    fast = fast and not torch.compiler.is_compiling() and lean_now()
    grad = x.requires_grad and torch.is_grad_enabled() if fast else None
    if fast:  # a call seen before: checked then, its launch bound
        key = (layout(x), dim, log)
        planned = FORWARD_PLANS.get(key)
        if planned is not None:
            return SoftmaxFunction.apply(x, log, planned) if grad else planned(x)
    dim = softmax_arguments(x, dim, log, SUPPORTED_DTYPES)  # raises, saying what to do
    if dim != x.dim() - 1:
        return softmax(x.movedim(dim, -1), log=log).movedim(-1, dim)
    if torch.compiler.is_compiling():  # an operator the compiler traces (below)
        return softmax_op(x, log)
    with recorded_launches(fast) as launches:
        if x.requires_grad and torch.is_grad_enabled():
            y = SoftmaxFunction.apply(x, log)
        else:  # autograd's machinery costs the CPU ~15 µs: skip it
            y = softmax_forward(x, log)
    if fast and (bound := bound_launches(launches, (x, y))):
        FORWARD_PLANS[key] = planned_forward(bound[0])
    return y


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.log_softmax(x, dim)`` for fp32, fp16 and bf16, with autograd (as softmax)."""
    return softmax(x, dim, log=True)


# %%
# ``torch.compile`` sees softmax as an operator of ``torch.library`` (chapter 08 explains the
# pattern): ``triton_op`` lets the compiler trace its kernels into a graph, and
# ``register_autograd`` gives the derivative. ``softmax`` calls it only while compiled.

# @save ops/softmax
from stepkernels.runtime.launch import concrete  # a kernel per shape, as in eager calls
from torch import Tensor
from torch.library import triton_op


@triton_op("stepkernels::softmax", mutates_args={})
def softmax_op(x: Tensor, log: bool) -> Tensor:
    return softmax_forward(concrete(x), log)  # over the last dimension


@triton_op("stepkernels::softmax_backward", mutates_args={})
def softmax_backward_op(y: Tensor, dy: Tensor, log: bool) -> Tensor:
    return softmax_backward(concrete(y), concrete(dy), log)


def softmax_setup(ctx, inputs, output):
    ctx.log = inputs[1]
    ctx.save_for_backward(output)


def softmax_op_backward(ctx, dy):
    name = "log_softmax" if ctx.log else "softmax"
    refuse_double_backward(name, f"torch.{name}")
    return softmax_backward_op(*ctx.saved_tensors, dy, ctx.log), None


softmax_op.register_autograd(softmax_op_backward, setup_context=softmax_setup)


# %%
# Correctness
# -----------
# Values and gradients against PyTorch's in fp64. We round once, at the store: the relative
# tolerance is one unit in the last place, 2^-10 for fp16, 2^-7 for bf16 (2^-6 under the
# interpreter, which truncates), 1e-5 for fp32; for gradients, scaled by the largest. Each
# new row length and dtype compiles kernels (seconds each on a GPU): a quick GPU run checks
# four of the seven shapes below (a ragged row, a strided slice, rows of -inf, a split row);
# ``STEPKERNELS_FULL=1`` checks all seven, as the interpreter does, and
# ``tests/test_softmax.py`` the other kinds (one value, leading dimensions, a transpose).

BF16 = 2**-6 if tutorial.INTERPRET else 2**-7
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: BF16}


def check_softmax(cases: list) -> None:
    """Values and gradients of softmax and log_softmax against torch in fp64."""
    for (dtype, rtol), x, log in itertools.product(TOLERANCES.items(), cases, (0, 1)):
        x = (4 * x).to(DEVICE, dtype).requires_grad_()
        x64, dy = x.detach().double().requires_grad_(), torch.randn_like(x)
        ours = (log_softmax if log else softmax)(x)
        theirs = (torch.log_softmax if log else torch.softmax)(x64, dim=-1)
        (dx,) = torch.autograd.grad(ours, x, dy)
        (dx64,) = torch.autograd.grad(theirs, x64, dy.double())
        close = functools.partial(torch.testing.assert_close, rtol=rtol, equal_nan=True)
        close(ours, theirs.to(dtype), atol=rtol / 4)
        close(dx, dx64.to(dtype), atol=rtol * dx64.abs().nan_to_num(0.0, 0.0).max())
    print(f"values and gradients match torch: {len(cases)} shapes x 3 dtypes")


torch.manual_seed(0)
masked = torch.randn(4, 50)
masked[0, ::3], masked[1] = -float("inf"), -float("inf")  # probability 0; NaN as torch
CASES = {
    "one value": torch.randn(1, 1),
    "one row": torch.randn(1, 781),  # not a power of two
    "leading dimensions": torch.randn(2, 3, 5, 100),
    "strided slice": torch.randn(9, 300)[:, 17:217],  # read in place
    "transposed": torch.randn(64, 12).t(),  # copied
    "masked": masked,
    "split row": torch.randn(2, tutorial.choose(gpu=262_144, cpu=MAX_FUSED_BLOCK + 3)),
}
QUICK_CASES = ["one row", "strided slice", "masked", "split row"]
CHECKED = tutorial.choose(gpu=QUICK_CASES, cpu=list(CASES), full=list(CASES))
check_softmax([CASES[name] for name in CHECKED])

# Inputs the kernels cannot take are refused with a message that says what to do:
x = torch.randn(8, 10, device=DEVICE)
bad_calls = {
    "integer dtype": lambda: softmax(x.int()),
    "float64": lambda: softmax(x.double()),
    "0-dim tensor": lambda: softmax(x[0, 0]),
    "wrong device": lambda: softmax(x.to("meta")),
}
tutorial.show_refusals("softmax()", bad_calls)

# %%
# Benchmarks
# ----------
# GPU time of each call (a CUDA graph replayed by ``do_bench``, L2 emptied before each), for
# 2 M N x (bytes per element) forward, 5 M N forward and backward, against the copy bandwidth
# (dashed) and a copy of the same bytes. M = 4,096 rows up to N = 32,768, then 2^26 / N.


def rows_for(n_cols: int) -> int:
    return tutorial.choose(gpu=4096 if n_cols <= 32768 else 2**26 // n_cols, cpu=3)


def make_softmax(provider: str, n_cols: int, dtype: torch.dtype, backward=False):
    x = torch.randn(rows_for(n_cols), n_cols, device=DEVICE, dtype=dtype)
    x.requires_grad_(backward)
    dy = torch.randn_like(x)
    eager = {"triton": softmax, "torch": torch_softmax, "naive": naive_softmax}
    fn = eager.get(provider) or bench.compile_static(torch_softmax)
    call = (lambda: torch.autograd.grad(fn(x), x, dy)) if backward else (lambda: fn(x))
    if provider == "torch.compile":
        call()  # compile now, not while timing
    return call


def torch_softmax(x):
    return torch.softmax(x, dim=-1)


def softmax_benchmark(name: str, passes: int, **fields) -> bench.Benchmark:
    return bench.Benchmark(
        name=name,
        make=functools.partial(make_softmax, backward=passes == 5),
        work=lambda n_cols, dtype: passes * rows_for(n_cols) * n_cols * dtype.itemsize,
        **{"dtypes": (torch.float32, torch.float16), "smoke_x": 100, **fields},
    )


def compare(results, x: int, others=("torch", "torch.compile", "naive")) -> None:
    """A table of triton's GB/s over each of ``others``' and over a copy's of the same
    bytes at ``x``, with the number of N at which triton is ahead of torch."""
    columns = [*others, bench.COPY_PROVIDER]
    print(f"{results.bench.name}: triton's GB/s over the others' at N = {x:,}")
    names = [c if c != bench.COPY_PROVIDER else "a copy" for c in columns]  # same bytes
    print(f"  {'':9}" + "".join(f"{c:>15}" for c in names) + "  ahead of torch")
    for dtype in dict.fromkeys(p.dtype for p in results.points):
        ratios = [results.ratio("triton", c, x, dtype) for c in columns]
        xs = sorted({p.x for p in results.points if p.dtype == dtype})
        ahead = sum(results.ratio("triton", "torch", n, dtype) > 1 for n in xs)
        row = "".join(f"{r:>14.2f}x" for r in ratios)
        print(f"  {dtype:9}{row}  at {ahead} of {len(xs)} N")


PROVIDERS = ["triton", "torch", "torch.compile", "naive", bench.COPY_PROVIDER]
forward = bench.run(
    softmax_benchmark(
        "softmax-forward",
        passes=2,
        x_name="N (columns), M = 4096 rows",
        x_values=[2**i for i in range(8, 16)] + [768, 3000, 12_000],
        providers=PROVIDERS,
        headline_x=4096,
    )
)
if forward:
    compare(forward, 4096)

# %%
# The naive version sits near a quarter of the others, as the bytes predict; the gap to
# ``torch.softmax``, fused too, is how well the bytes are kept moving. Below N = 1,024 every
# provider falls short of the copy line: 4 MB take under 3 µs, what a kernel takes to ramp up.
#
# Forward and backward
# --------------------
# Training runs both: each provider computes y, then dx through ``torch.autograd.grad``.

forward_backward = bench.run(
    softmax_benchmark(
        "softmax-forward-backward",
        passes=5,
        x_name="N (columns); M = 4096, or 2^26 / N from N = 65,536",
        x_values=[2**i for i in range(8, 19)],
        providers=PROVIDERS,
        headline_x=4096,
    )
)
if forward_backward:
    compare(forward_backward, 4096)
    compare(forward_backward, 131_072, others=("torch", "torch.compile"))

# %%
# Past N = 32,768 both directions split rows over programs and read every tensor once from
# memory. In fp16 they stay short of a copy (printed), the forward most: a program waiting for
# its row's pairs has none of its loads in flight. Dotted lines time calls from Python (the
# tables add their CPU time): through autograd, the CPU paces ours.
#
# What we learned
# ---------------
# * Fusion turns eight passes over memory into two; then speed is bytes in flight.
# * The online softmax handles rows of any length; programs that split a row and publish
#   (max, sum) pairs remove its second read, with a release/acquire pair and a way out.
# * Both backwards are a row reduction and an elementwise step on the forward's output.
# * The launch rules and the split kernels' choices (hold or read again, the way out's block)
#   are measurements on an H100: ``lab/NOTES.md`` keeps the sweeps behind them.
#
# Exercises
# ---------
# 1. Fuse a ``scale`` and an additive ``mask`` into the load: softmax(scale * x + mask),
#    the core of attention. How many bytes does the mask add?
# 2. Fuse the cross-entropy loss: log_softmax(x)[target] for a target index per row,
#    without writing the log-softmax out. What is the traffic now?
# 3. Write the long-row backward the other way: one program walks its row twice (the sum,
#    then dx), reading y and dy twice. Count its bytes at N = 131,072 and time it against
#    the split kernel. (``lab/softmax_split_backward.py`` has one.)
