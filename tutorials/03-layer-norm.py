r"""
Layer normalization: forward, backward, and a lock done right
==============================================================

We write layer normalization's forward and backward as Triton kernels behind an autograd
function that matches ``torch.nn.functional.layer_norm``, and measure them against PyTorch,
``torch.compile`` and Liger-Kernel. What you will learn:

* how to normalize a row in one read of memory, stably (rows too long for a program: chapter
  13);
* why ``dW`` and ``dB``, sums over *all* rows, need the programs to cooperate;
* a spin lock built from ``tl.atomic_cas``, and why it needs a barrier before its release;
* a deterministic two-stage reduction, and what each method costs.

Prerequisites: chapter 01. Without a GPU every cell runs under Triton's interpreter.
"""

# %%
# Setup
# -----

import itertools

from stepkernels.lessons import bench, check_layer_norm, tutorial
from stepkernels.lessons.figures_layer_norm import draw_lock_reduction
import torch
import triton
import triton.language as tl

tutorial.announce()
DEVICE = tutorial.DEVICE
# sphinx_gallery_thumbnail_number = 2

# %%
# What layer normalization computes, and what it must move
# --------------------------------------------------------
# For each row x of N numbers (the trailing ``normalized_shape`` dimensions), with a weight w
# and a bias b shared by all M rows, and dy the gradient of the loss with respect to y:
#
#     mean = sum(x) / N,   rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)
#     x_hat = (x - mean) * rstd,   y = x_hat * w + b
#     dx = rstd * (w dy - (c1 x_hat + c2)),   c1 = sum(x_hat w dy) / N,   c2 = sum(w dy) / N
#     dW = sum over rows of dy x_hat,   dB = sum over rows of dy
#
# The forward must read x and write y, 2 × M × N elements: 67 MB for M = N = 4,096 in fp16,
# 22 µs at the 3 TB/s an H100 copies at. The backward reads x and dy and writes dx, 3 × M × N;
# dx needs sums along its own row only, but dW and dB sum over rows held by other programs.
#
# The forward kernel
# ------------------
# A program normalizes ``ROWS_PER_PROGRAM × BLOCK_N`` values. var = mean(x²) - mean(x)² cancels
# when the mean is large next to the spread, so we take the mean, then the variance of
# ``x - mean``, from registers. Short rows are packed into tiles of several rows, and a capped
# grid of programs loops over the tiles, loading the next while it normalizes this one: a tile
# of one short row is too few bytes to keep the memory busy. From 4,096 values a row takes a
# program and the grid has no cap, except for rows of 32 KB, where the capped grid measured
# faster on an H100.
# A row longer than ``FORWARD_MAX_BLOCK`` does not fit in a program's registers; walking it
# block by block would read it twice, so chapter 13 splits it over programs.

# @save ops/layer_norm
import functools
import math

from stepkernels.ops import (
    long_rows,  # chapter 13's kernels, for rows past these limits
)
from stepkernels.runtime.arguments import (  # checks
    layer_norm_arguments,
    reduction_argument,
)
from stepkernels.runtime.core import INTERPRET, refuse_double_backward, sm_count
from stepkernels.runtime.device import profile
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
from stepkernels.runtime.partials import flush_partials, sum_partials
import torch
import triton
import triton.language as tl


@lean
@triton.jit
def layer_norm_forward_kernel(
    x_ptr,
    y_ptr,
    weight_ptr,
    bias_ptr,
    mean_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    M,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Row blocks p, p + grid size, ...: with NUM_STAGES > 1 the next block's loads are
    # issued before this one's arithmetic.
    program_id, grid_size = tl.program_id(axis=0), tl.num_programs(axis=0)
    n_blocks = tl.cdiv(M, ROWS_PER_PROGRAM)
    for block in tl.range(program_id, n_blocks, grid_size, num_stages=NUM_STAGES):
        rows = block * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        cols = tl.arange(0, BLOCK_N)
        row_mask, col_mask = rows < M, cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)  # row * stride can pass 2**31
        x_ptrs = x_ptr + rows64[:, None] * x_row_stride + cols[None, :]
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        centered = tl.where(mask, x - mean[:, None], 0.0)  # 0 on masked-off lanes
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
        y = centered * rstd[:, None]
        if HAS_WEIGHT:
            y *= tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y_ptrs = y_ptr + rows64[:, None] * y_row_stride + cols[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FORWARD_MAX_BLOCK, SPLIT_CHUNK = 32768, 8192  # longer rows: split in chunks
FORWARD_TILE, FORWARD_SHORT_TILE, FORWARD_SHORT_ROW = 8192, 4096, 2048
FORWARD_PROGRAMS_PER_SM = 8
FORWARD_STAGES = 2  # loads in flight: Triton keeps NUM_STAGES - 1 blocks of them


def stage_bytes() -> int:
    """Shared memory for loads in flight: the device's (runtime/device.py), less 1 KB for
    the reductions' scratch (tools/check_targets.py checks the launches against it)."""
    return profile().shared_memory - 1024


@functools.cache  # once per shape: off the call's path
def forward_config(n_cols, n_rows, block_size=None, itemsize=4, param_bytes=0) -> dict:
    max_block = block_size or FORWARD_MAX_BLOCK  # block_size: a cap, for tests
    block = triton.next_power_of_2(n_cols)
    if block > max_block:  # too long for a program: split over several, chapter 13
        return dict(BLOCK_N=min(max_block, SPLIT_CHUNK), num_warps=4)
    row_bytes = block * itemsize
    if block > FORWARD_SHORT_ROW and row_bytes != 32 * 1024:  # a row a program, no cap
        return dict(
            BLOCK_N=block,
            ROWS_PER_PROGRAM=1,
            NUM_STAGES=1,
            num_warps=8 if row_bytes < 32 * 1024 else 32,
        )
    tile = FORWARD_SHORT_TILE if block <= FORWARD_SHORT_ROW else FORWARD_TILE
    rows = max(1, min(tile // block, triton.next_power_of_2(n_rows)))
    per_stage = rows * block * itemsize + block * param_bytes  # x, weight and bias
    stages = max(1, min(FORWARD_STAGES, 1 + stage_bytes() // per_stage))
    return dict(
        BLOCK_N=block,
        ROWS_PER_PROGRAM=rows,
        NUM_STAGES=stages,
        num_warps=max(1, min(16, rows * block // 1024)),
        programs=FORWARD_PROGRAMS_PER_SM * sm_count(),
    )


def layer_norm_forward(x2d, weight, bias, eps, block_size=None, config=None):
    """y, mean, rstd of a 2-D ``x2d`` with contiguous rows; ``config`` replaces the
    launch rule's choice."""
    (n_rows, n_cols), device = x2d.shape, x2d.device
    y = torch.empty((n_rows, n_cols), device=device, dtype=x2d.dtype)
    mean, rstd = (torch.empty(n_rows, device=device, dtype=torch.float32) for _ in "mr")
    if n_rows == 0:
        return y, mean, rstd
    size = x2d.element_size()
    params = sum(p.element_size() for p in (weight, bias) if p is not None)
    config = dict(config or forward_config(n_cols, n_rows, block_size, size, params))
    tensors = (
        x2d,
        y,
        x2d if weight is None else weight,
        x2d if bias is None else bias,
        mean,
        rstd,
    )
    affine = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    strides = (x2d.stride(0), y.stride(0))
    if config["BLOCK_N"] < next_power_of_2(n_cols):  # a row in chunks: split
        long_rows.split_forward(tensors, strides, affine, n_rows, n_cols, eps, config)
        return y, mean, rstd
    grid = cdiv(n_rows, config["ROWS_PER_PROGRAM"])
    grid = min(grid, config.pop("programs", None) or grid)  # a cap on the grid
    layer_norm_forward_kernel[(grid,)](
        *tensors, *strides, n_rows, n_cols, eps, **affine, **config
    )
    return y, mean, rstd


# %%
# The backward, and the problem with dW and dB
# --------------------------------------------
# A program takes ``ROWS_PER_PROGRAM`` rows: it rebuilds x_hat from the saved mean and rstd, writes
# dx, and sums ``dy * x_hat`` and ``dy`` over its rows in registers. The programs' partials must
# then be combined (``tl.atomic_add``: N fp32 atomics per program, in varying order). Two ways,
# each ending in a kernel that sums in a fixed order: **a lock**, program p adding into buffer
# p % GROUP_SIZE_M while it holds that buffer's lock (drawn below), and **two stages**.
#
# **A spin lock needs a barrier.** The lock is an int32, 0 when free: ``tl.atomic_cas(lock, 0,
# 1)`` writes 1 if it finds 0 and returns what it found (0: we hold it); ``tl.atomic_xchg(lock,
# 0)`` frees it. In between, the program's 128 to 512 threads each store a slice of the buffer,
# but an atomic is issued by one thread, which without a barrier can free the lock while others'
# stores are in flight: a partial is lost, on some runs, on some GPUs (tritonbench PR #1266 saw
# dW/dB corrupted in about 99 runs of 100 on an RTX 4090). ``tl.debug_barrier()`` makes the
# release wait for every thread's stores; *release* semantics publish them before the lock reads
# free, and the next ``atomic_cas``'s *acquire* makes its holder see them, from L2 (``.cg``: L1s
# are not coherent). Buffers come from ``torch.empty``: visits counted per lock bar garbage.

draw_lock_reduction(n_programs=8, group_size_m=3)

# %%
# Rows past M load as zeros and add nothing. Fewer programs write fewer partials but idle
# waiting for loads, unless the row loop is pipelined: with 3 or 4 stages (up to 96 KB of x and
# dy in flight), one program per SM measured best from N = 4,096. ``sum_partials_kernel``
# takes up to 256 partials at a time, so that all of a column block's loads are in flight
# together. Longer rows than ``BACKWARD_MAX_BLOCK``: chapter 13, whose split kernels flush
# their sums the same way, so ``flush_partials`` lives in the package's runtime layer
# (``stepkernels.runtime.partials``). It takes its arguments in groups: the two buffers, the
# two sums, the columns, and where in the buffers this program's sums go.


# @save runtime/partials
import triton
import triton.language as tl


@triton.jit
def flush_partials(buffers, sums, columns, N, slots, REDUCTION: tl.constexpr):
    """Hand a program's sums over its rows, ``sums`` = (dw, db), to the ``REDUCTION``.

    ``buffers``: (partial_ptr, lock_ptr), rows of 2 N fp32 sums (N for dW, then N for
    dB), and for "lock" the locks followed by as many visit counters; ``columns``:
    (cols, col_mask), the columns of the row that ``sums`` cover; ``slots``: (slot,
    lock_index, num_locks), the partial row written ("two-stage") or added into under
    lock ``lock_index`` of ``num_locks`` ("lock")."""
    partial_ptr, lock_ptr = buffers
    dw, db = sums
    cols, col_mask = columns
    slot, lock_index, num_locks = slots
    row_ptr = partial_ptr + slot.to(tl.int64) * 2 * N  # N dW sums, then N dB sums, fp32
    if REDUCTION == "two-stage":
        tl.store(row_ptr + cols, dw, mask=col_mask)
        tl.store(row_ptr + N + cols, db, mask=col_mask)
    elif REDUCTION == "lock":
        lock, visits_ptr = lock_ptr + lock_index, lock_ptr + num_locks + lock_index
        while tl.atomic_cas(lock, 0, 1, sem="acquire") == 1:
            pass
        # Held. Count the visit; the first visitor finds garbage and must not read it.
        visits = tl.atomic_add(visits_ptr, 1, sem="relaxed")
        earlier = cols < tl.where(visits > 0, N, 0)
        dw += tl.load(row_ptr + cols, mask=earlier, other=0.0, cache_modifier=".cg")
        db += tl.load(row_ptr + N + cols, mask=earlier, other=0.0, cache_modifier=".cg")
        tl.store(row_ptr + cols, dw, mask=col_mask)
        tl.store(row_ptr + N + cols, db, mask=col_mask)
        tl.debug_barrier()  # every thread's stores issued before the release
        tl.atomic_xchg(lock, 0, sem="release")


# %%
# The backward kernel walks its rows, then flushes its partial sums:


# @save ops/layer_norm
@lean
@triton.jit
def layer_norm_backward_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    weight_ptr,
    mean_ptr,
    rstd_ptr,
    partial_ptr,
    lock_ptr,
    x_row_stride,
    dy_row_stride,
    dx_row_stride,
    M,
    N,
    num_locks,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    REDUCTION: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    program_id = tl.program_id(axis=0)
    first_row = program_id * ROWS_PER_PROGRAM
    slot = program_id % GROUP_SIZE_M if REDUCTION == "lock" else program_id
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw, db = tl.zeros([BLOCK_N], tl.float32), tl.zeros([BLOCK_N], tl.float32)
    # NUM_STAGES > 1: the next rows' loads are issued before this row's arithmetic
    for i in tl.range(ROWS_PER_PROGRAM, num_stages=NUM_STAGES):
        row = first_row + i
        mask, row64 = cols < tl.where(row < M, N, 0), row.to(tl.int64)
        x = tl.load(x_ptr + row64 * x_row_stride + cols, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + row64 * dy_row_stride + cols, mask=mask, other=0.0)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        safe_row = tl.minimum(row, M - 1)  # rows past M read row M - 1, add nothing
        mean, rstd = tl.load(mean_ptr + safe_row), tl.load(rstd_ptr + safe_row)
        x_hat, wdy = (x - mean) * rstd, w * dy if HAS_WEIGHT else dy
        c1, c2 = tl.sum(x_hat * wdy, axis=0) / N, tl.sum(wdy, axis=0) / N
        dx = (wdy - (x_hat * c1 + c2)) * rstd
        dx_ptrs = dx_ptr + row64 * dx_row_stride + cols
        tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw, db = dw + dy * x_hat, db + dy  # masked lanes: dy = 0
    if REDUCTION != "none":
        buffers, slots = (partial_ptr, lock_ptr), (slot, slot, num_locks)
        flush_partials(buffers, (dw, db), (cols, col_mask), N, slots, REDUCTION)


# %%
# The second stage adds the partial rows, in a fixed order, into dW and dB. It lives with
# ``flush_partials`` in ``runtime/partials``: chapter 15's fused norm reduces with it too.

# @save runtime/partials
from stepkernels.runtime.core import sm_count  # noqa: E402
from stepkernels.runtime.launch import cdiv, lean, next_power_of_2  # noqa: E402


@lean
@triton.jit
def sum_partials_kernel(
    partial_ptr,
    visits_ptr,
    dw_ptr,
    db_ptr,
    num_partials,
    N,
    HAS_COUNTS: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(axis=0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for first in tl.range(0, num_partials, BLOCK_P, num_stages=2):
        slots = first + tl.arange(0, BLOCK_P)
        keep = slots < num_partials
        if HAS_COUNTS:  # lock buffers no program visited hold garbage
            keep = keep & (tl.load(visits_ptr + slots, mask=keep, other=0) > 0)
        mask = keep[:, None] & col_mask[None, :]
        ptrs = partial_ptr + slots.to(tl.int64)[:, None] * 2 * N + cols[None, :]
        if HAS_DW:
            dw += tl.load(ptrs, mask=mask, other=0.0)
        if HAS_DB:
            db += tl.load(ptrs + N, mask=mask, other=0.0)
    if HAS_DW:  # one rounding, into the weight's dtype
        dw_sum = tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty)
        tl.store(dw_ptr + cols, dw_sum, mask=col_mask)
    if HAS_DB:
        db_sum = tl.sum(db, axis=0).to(db_ptr.dtype.element_ty)
        tl.store(db_ptr + cols, db_sum, mask=col_mask)


def sum_partials(partials, visits, dw, db, n_cols, **flags):
    """``sum_partials_kernel`` over the rows of ``partials`` (one a program of the first
    stage), with ``flags`` its HAS_COUNTS, HAS_DW and HAS_DB: narrow column blocks, two
    programs per SM whenever N allows, each program's rows loaded in tiles of up to
    4,096 sums, all in flight together."""
    block_n = min(128, max(16, next_power_of_2(cdiv(n_cols, 2 * sm_count()))))
    n_partials = partials.shape[0]
    block_p = min(next_power_of_2(n_partials), max(32, 4096 // block_n))
    sum_partials_kernel[(cdiv(n_cols, block_n),)](
        partials,
        visits,
        dw,
        db,
        n_partials,
        n_cols,
        **flags,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=4,
    )


# %%
# @save ops/layer_norm
REDUCTIONS = ("two-stage", "lock")
BACKWARD_MAX_BLOCK = 8192  # longer rows are split over programs
BACKWARD_STAGES, BACKWARD_STAGE_BYTES = 4, 96 * 1024  # pipelined loads of x and dy
GROUP_SIZE_M = 64


@functools.cache
def backward_config(n_cols, n_rows, block_size=None, rows_per_program=None, itemsize=4):
    max_block = block_size or BACKWARD_MAX_BLOCK
    block = triton.next_power_of_2(n_cols)
    if block > max_block:  # split (chapter 13): 8 (16-bit) or 4 rows of 1,024 columns
        chunk = min(
            max_block, max(1024, triton.next_power_of_2(triton.cdiv(n_cols, 64)))
        )
        # values a batch: fp32 spills at 8,192, and so does 16-bit in chunks of 4,096
        values = 8192 if itemsize < 4 and chunk <= 2048 else 4096
        batch = max(1, min(values // chunk, triton.next_power_of_2(n_rows)))
        groups = 4 if INTERPRET else 32  # of up to 128 rows; CPU: few
        rows = rows_per_program or triton.next_power_of_2(triton.cdiv(n_rows, groups))
        rows = min(128, max(batch, rows))
        return dict(
            BLOCK_N=chunk,
            ROWS_PER_PROGRAM=rows,
            BATCH=batch if rows % batch == 0 else 1,
            num_warps=4,
        )
    if rows_per_program is None:
        programs = 4 if INTERPRET else max(1, 4096 // block) * sm_count()  # CPU: few
        wanted = triton.cdiv(n_rows, programs)
        rows_per_program = min(64, triton.next_power_of_2(wanted))
    per_stage = 2 * block * itemsize  # a row of x and one of dy
    budget = min(BACKWARD_STAGE_BYTES, stage_bytes())
    stages = max(1, min(BACKWARD_STAGES, budget // per_stage))
    return dict(
        BLOCK_N=block,
        ROWS_PER_PROGRAM=rows_per_program,
        NUM_STAGES=stages,
        num_warps=max(4, min(16, block // 1024)),
    )


def layer_norm_backward(
    dy2d,
    x2d,
    weight,
    mean,
    rstd,
    want_dw=True,
    want_db=True,
    reduction="two-stage",
    group_size_m=None,
    rows_per_program=None,
    block_size=None,
    config=None,
):
    """dx, dW, dB (None unless wanted); ``config`` replaces the launch rule's choice."""
    (n_rows, n_cols), device = x2d.shape, x2d.device
    grad_dtype = x2d.dtype if weight is None else weight.dtype
    dx = torch.empty((n_rows, n_cols), device=device, dtype=x2d.dtype)
    dw, db = (
        torch.empty(n_cols, device=device, dtype=grad_dtype) if wanted else None
        for wanted in (want_dw, want_db)
    )
    if n_rows == 0:  # sums over no rows
        return dx, *(None if grad is None else grad.zero_() for grad in (dw, db))
    size, per_program = x2d.element_size(), rows_per_program
    config = config or backward_config(n_cols, n_rows, block_size, per_program, size)
    n_programs = cdiv(n_rows, config["ROWS_PER_PROGRAM"])  # or groups of rows
    mode = reduction if (want_dw or want_db) else "none"
    group = group_size_m or GROUP_SIZE_M
    num_locks, locks, partials = 0, dx, dx  # "none": never touched
    if mode == "lock":
        partials = torch.empty((group, 2, n_cols), device=device, dtype=torch.float32)
        num_locks = group * cdiv(n_cols, config["BLOCK_N"])
        # locks, then visit counters: the only memory that needs zeroing
        locks = torch.zeros(2 * num_locks, device=device, dtype=torch.int32)
    elif mode == "two-stage":
        shape = (n_programs, 2, n_cols)
        partials = locks = torch.empty(shape, device=device, dtype=torch.float32)
    tensors = (
        x2d,
        dy2d,
        dx,
        x2d if weight is None else weight,
        mean,
        rstd,
        partials,
        locks,
    )
    strides = (x2d.stride(0), dy2d.stride(0), dx.stride(0))
    options = dict(HAS_WEIGHT=weight is not None, REDUCTION=mode, GROUP_SIZE_M=group)
    if config["BLOCK_N"] < next_power_of_2(n_cols):  # a row in chunks: split
        long_rows.split_backward(
            tensors, strides, options, n_rows, n_cols, num_locks, config
        )
    else:
        layer_norm_backward_kernel[(n_programs,)](
            *tensors, *strides, n_rows, n_cols, num_locks, **options, **config
        )
    if mode != "none":  # the second stage (runtime/partials, below)
        sum_partials(
            partials,
            locks[num_locks:],
            dx if dw is None else dw,
            dx if db is None else db,
            n_cols,
            HAS_COUNTS=mode == "lock",
            HAS_DW=want_dw,
            HAS_DB=want_db,
        )
    return dx, dw, db


# %%
# The function and the module
# ---------------------------
# ``layer_norm`` takes ``torch.nn.functional.layer_norm``'s arguments. Rows may lie any distance
# apart (a slice ``x[:, :N]`` is used as it is). Bad input and a double backward are refused.


# @save ops/layer_norm
def is_vector(tensor) -> bool:
    return tensor.dim() == 1 and tensor.stride(0) == 1


def rows_of(tensor, n_cols):
    """A 2-D view of ``tensor`` with contiguous rows; copies only when there is none."""
    if tensor.dim() == 2 and tensor.shape[1] == n_cols and tensor.stride(1) == 1:
        return tensor  # the common case, without a view (a microsecond a call)
    rows = tensor.reshape(-1, n_cols)
    return rows.contiguous() if rows.stride(1) != 1 and n_cols > 1 else rows


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, normalized_shape, eps, reduction, block_size, key, planned
    ):
        if planned is not None:  # a repeated call's bound launch (chapter 08)
            y, x2d, weight, mean, rstd = planned(x, weight, bias)
        else:
            x2d = rows_of(x, math.prod(normalized_shape))
            flat = lambda p: (
                p if p is None or is_vector(p) else p.reshape(-1).contiguous()
            )
            flat_weight, flat_bias = flat(weight), flat(bias)
            with recorded_launches(key is not None) as launches:
                y, mean, rstd = layer_norm_forward(
                    x2d, flat_weight, flat_bias, eps, block_size
                )
            unchanged = x2d is x and flat_weight is weight and flat_bias is bias
            if key is not None and unchanged:
                params = (x if weight is None else weight, x if bias is None else bias)
                bound = bound_launches(launches, (x, y, *params, mean, rstd))
                if bound:
                    FORWARD_PLANS[key] = planned_forward(*bound, len(mean))
            weight, y = flat_weight, y if y.shape == x.shape else y.view(x.shape)
        if ctx is not None:  # None: called without autograd, nothing to save
            ctx.save_for_backward(x2d, weight, mean, rstd)
            ctx.normalized_shape, ctx.has_bias = normalized_shape, bias is not None
            ctx.reduction, ctx.block_size, ctx.key = reduction, block_size, key
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("layer_norm", "torch.nn.functional.layer_norm")
        x2d, weight, mean, rstd = ctx.saved_tensors
        want_dw = weight is not None and ctx.needs_input_grad[1]
        want_db = ctx.has_bias and ctx.needs_input_grad[2]
        key = ctx.key if ctx.key is None or type(dy) is torch.Tensor else None
        if key is not None:  # a repeated call: dy's layout too
            key = (key, layout(dy), want_dw, want_db)
            planned = BACKWARD_PLANS.get(key)
            if planned is not None and lean_now():
                dx, dw, db = planned(x2d, dy, weight, mean, rstd)
                return dx, dw, db, None, None, None, None, None, None
        saved = (x2d, weight, mean, rstd)
        options = dict(reduction=ctx.reduction, block_size=ctx.block_size)
        with recorded_launches(key is not None) as launches:
            dy2d = rows_of(dy, x2d.shape[1])
            dx, dw, db = layer_norm_backward(dy2d, *saved, want_dw, want_db, **options)
        if key is not None and dy2d is dy and ctx.reduction == "two-stage":
            plan_backward(key, launches, saved, dy, dx, dw, db)
        if len(ctx.normalized_shape) > 1:
            dw, db = (
                g if g is None else g.view(ctx.normalized_shape) for g in (dw, db)
            )
        dx = dx if dx.shape == dy.shape else dx.view(dy.shape)
        return dx, dw, db, None, None, None, None, None, None


# A repeated call launches its kernels bound (chapter 08), under a key of all that they
# read from the call: each tensor's layout, and the other arguments as given.
FORWARD_PLANS, BACKWARD_PLANS = plan_cache(), plan_cache()
TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def call_key(x, shape, weight, bias, eps, reduction, block_size) -> tuple | None:
    """What the launches of a ``layer_norm`` call read from it, or None: the call is not
    keyed (traced, or arguments whose value alone does not say they pass the checks)."""
    keyed = type(x) in TENSOR_TYPES and type(eps) is float and block_size is None
    keyed = keyed and (weight is None or type(weight) in TENSOR_TYPES)
    keyed = keyed and (bias is None or type(bias) in TENSOR_TYPES)
    if keyed and type(shape) is not torch.Size and type(shape) is not int:
        keyed = type(shape) is tuple and len(shape) == 1 and type(shape[0]) is int
    if not keyed or torch.compiler.is_compiling() or not lean_now():
        return None
    return layout(x), shape, layout(weight), layout(bias), eps, reduction


def planned_forward(launch, n_rows):
    def forward(x, weight, bias):
        device = x.device
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        mean = torch.empty(n_rows, device=device, dtype=torch.float32)
        rstd = torch.empty(n_rows, device=device, dtype=torch.float32)
        params = (x if weight is None else weight, x if bias is None else bias)
        launch(x, y, *params, mean, rstd)
        return y, x, weight, mean, rstd

    return forward


def plan_backward(key, launches, saved, dy, dx, dw, db):
    """Bind the backward's launches (two-stage: the rows, then the partial sums; without
    dW and dB, the rows alone) for the calls with ``key``."""
    x2d, weight, mean, rstd = saved
    rows = (x2d, dy, dx, x2d if weight is None else weight, mean, rstd)
    if dw is None and db is None:
        bound = bound_launches(launches, (*rows, dx, dx))
    elif len(launches) == 2:
        partials = launches[0][2][6]
        sums = (partials, partials, dx if dw is None else dw, dx if db is None else db)
        bound = bound_launches(launches, (*rows, partials, partials), sums)
    else:
        return
    if not bound:
        return
    shapes = (
        partials.shape if len(bound) == 2 else None,
        dw is not None,
        db is not None,
    )
    BACKWARD_PLANS[key] = planned_backward(
        bound, *shapes, (dw if dw is not None else db)
    )


def planned_backward(bound, partials_shape, want_dw, want_db, like):
    def backward(x2d, dy, weight, mean, rstd):
        device = x2d.device
        dx = torch.empty_like(x2d, memory_format=torch.contiguous_format)
        dw = torch.empty_like(like) if want_dw else None
        db = torch.empty_like(like) if want_db else None
        rows = (x2d, dy, dx, x2d if weight is None else weight, mean, rstd)
        if partials_shape is None:
            bound[0](*rows, dx, dx)
            return dx, dw, db
        partials = torch.empty(partials_shape, device=device, dtype=torch.float32)
        bound[0](*rows, partials, partials)
        bound[1](partials, partials, dx if dw is None else dw, dx if db is None else db)
        return dx, dw, db

    return backward


def layer_norm(
    x,
    normalized_shape,
    weight=None,
    bias=None,
    eps=1e-5,
    *,
    reduction="two-stage",
    block_size=None,
):
    """``torch.nn.functional.layer_norm`` in Triton. ``reduction``: "two-stage" (the
    same bits every run) or "lock"; ``block_size``: a power of two, the most of a row
    loaded at once."""
    given = (x, normalized_shape, weight, bias, eps, reduction, block_size)
    key = call_key(*given)
    planned = None if key is None else FORWARD_PLANS.get(key)
    if planned is not None:  # seen before: checked then
        shape = (
            (normalized_shape,) if type(normalized_shape) is int else normalized_shape
        )
    else:
        shape = layer_norm_arguments(*given, SUPPORTED_DTYPES, REDUCTIONS)  # or raises
    args = (x, weight, bias, shape, float(eps), reduction, block_size)
    # Operators the compiler traces (below); a call is keyed only when not compiling.
    if key is None and torch.compiler.is_compiling():
        return traced_layer_norm(*args)
    args = (*args, key, planned)
    grads = x.requires_grad or (weight is not None and weight.requires_grad)
    grads = grads or (bias is not None and bias.requires_grad)
    if grads and torch.is_grad_enabled():
        return LayerNormFunction.apply(*args)
    return LayerNormFunction.forward(None, *args)  # no autograd: ~15 µs less CPU


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` on these kernels: same arguments, parameters and state
    dict."""

    def __init__(self, *args, reduction="two-stage", **kwargs):
        super().__init__(*args, **kwargs)
        reduction_argument(reduction, REDUCTIONS)  # refused now, not at the first call
        self.reduction = reduction

    def forward(self, x):
        args = (x, self.normalized_shape, self.weight, self.bias, self.eps)
        return layer_norm(*args, reduction=self.reduction)

    def extra_repr(self):
        return f"{super().extra_repr()}, reduction={self.reduction!r}"


# %%
# The same layer norm as two operators of ``torch.library``, which ``torch.compile`` traces
# into its graphs (chapter 08 explains how): ``layer_norm`` calls them while being compiled.

# @save ops/layer_norm
from stepkernels.runtime.launch import concrete  # a kernel per shape, as in eager calls
from torch import Tensor
from torch.library import triton_op


@triton_op("stepkernels::layer_norm_forward", mutates_args={})
def layer_norm_forward_op(
    x2d: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return layer_norm_forward(concrete(x2d), weight, bias, eps)  # y, mean, rstd


@triton_op("stepkernels::layer_norm_backward", mutates_args={})
def layer_norm_backward_op(
    dy2d: Tensor,
    x2d: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    want_dw: bool,
    want_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    rows = (concrete(dy2d), concrete(x2d))
    dx, dw, db = layer_norm_backward(*rows, weight, mean, rstd, want_dw, want_db)
    none = lambda: x2d.new_empty(0)  # an operator returns fresh tensors, never None
    return dx, none() if dw is None else dw, none() if db is None else db


def save_for_backward(ctx, inputs, output):
    x2d, weight, bias, _ = inputs
    ctx.save_for_backward(x2d, weight, *output[1:])
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)  # mean and rstd get no gradient


def backward(ctx, dy, _mean_grad, _rstd_grad):
    refuse_double_backward("layer_norm", "torch.nn.functional.layer_norm")
    x2d, weight, mean, rstd = ctx.saved_tensors
    want_dw = weight is not None and ctx.needs_input_grad[1]
    want_db = ctx.has_bias and ctx.needs_input_grad[2]
    grads = layer_norm_backward_op(
        dy.contiguous(), x2d, weight, mean, rstd, want_dw, want_db
    )
    return grads[0], grads[1] if want_dw else None, grads[2] if want_db else None, None


layer_norm_forward_op.register_autograd(backward, setup_context=save_for_backward)


def traced_layer_norm(x, weight, bias, shape, eps, reduction=None, block_size=None):
    """``layer_norm``, its arguments checked, through the operators above: the launch
    rule's block size, and dW, dB added in two stages (the same bits every run)."""
    x2d = rows_of(x, math.prod(shape))
    flat = lambda p: None if p is None else p.reshape(-1).contiguous()
    y, _, _ = layer_norm_forward_op(x2d, flat(weight), flat(bias), eps)
    return y.view(x.shape)


# %%
# Correctness, and the two reductions compared
# --------------------------------------------
# ``check_layer_norm`` compares y, dx, dW and dB with PyTorch's in fp64 for each dtype and
# reduction, within one rounding of the dtype; another call runs each backward 20 times: its time
# (GPU), how much dW changes between runs, its error. The lock adds partials in the order programs
# reach it, which varies on a GPU; the interpreter's fixed order can show no race. Each
# shape and dtype compiles kernels, seconds each on a GPU: a quick GPU run checks three of the
# six cases (a ragged row, strided rows, a row split over programs), ``STEPKERNELS_FULL=1``
# and the interpreter all six; ``tests/test_layer_norm.py`` checks each kind on every run.

keep = lambda t: t
CASES = [  # shape, normalized dimensions, view, block_size
    ((1, 300), 1, keep, None),  # one row
    ((19, 781), 1, keep, None),  # not a power of two
    ((4, 6, 10), 2, keep, None),  # two normalized dimensions
    ((16, 200), 1, lambda t: t[:, :100], None),  # rows 200 apart: used as they are
    ((64, 24), 1, lambda t: t.t(), None),  # columns not adjacent: copied
    ((21, 300), 1, keep, 128),  # split over programs, 128 values each (chapter 13)
]
QUICK_CASES = [CASES[1], CASES[3], CASES[5]]
check_layer_norm.check(
    layer_norm, tutorial.choose(gpu=QUICK_CASES, cpu=CASES, full=CASES)
)
n_rows, n_cols = bench.choose(gpu=4096, cpu=16), bench.choose(gpu=4096, cpu=256)
compare = check_layer_norm.compare_reductions
compare(layer_norm_forward, layer_norm_backward, n_rows, n_cols)

# %%
# Benchmarks
# ----------
# M = 4,096 rows, N from 1,024 to 65,536, fp16 and fp32, counting the compulsory bytes (2 × M × N
# elements forward; 3 × M × N backward, timed alone through a saved graph). Filling and draining
# the GPU weighs here, so the reference is ``copy (same bytes)``, a Triton copy of those bytes.

PROVIDERS = ["triton (lock)", "triton (two-stage)", "torch", "torch.compile"]
try:  # Liger-Kernel, where installed
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
except ImportError:
    LigerLayerNormFunction = None
PROVIDERS += ["liger_kernel"] if LigerLayerNormFunction else []
BENCH_ROWS = bench.choose(gpu=4096, cpu=8)


def make_call(provider, n_cols, dtype, backward):
    """The call to time: one forward, or one backward through a saved graph."""
    x = torch.randn(BENCH_ROWS, n_cols, device=DEVICE, dtype=dtype)
    w, b = (torch.rand(n_cols, device=DEVICE, dtype=dtype) for _ in "wb")
    x, w, b = (t.requires_grad_(backward) for t in (x, w, b))
    torch_fn = torch.nn.functional.layer_norm
    if provider.startswith("triton"):
        reduction = provider[len("triton (") : -1]
        fn = lambda x, w, b: layer_norm(x, x.shape[-1:], w, b, reduction=reduction)
    elif provider == "liger_kernel":
        fn = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5)
    else:  # torch.compile compiles for each shape, at the first call below
        compiled = bench.compile_static(torch_fn) if provider != "torch" else torch_fn
        fn = lambda x, w, b: compiled(x, x.shape[-1:], w, b)
    y = fn(x, w, b)
    if not backward:
        return lambda: fn(x, w, b)
    dy = torch.randn_like(y)
    return lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)


def benchmark(name, backward):
    return bench.Benchmark(
        name=name,
        x_name="N (columns), M = 4096 rows",
        x_values=bench.choose(gpu=[2**i for i in range(10, 17)], cpu=[256]),
        providers=[*PROVIDERS, bench.COPY_PROVIDER],
        make=lambda provider, n, dtype: make_call(provider, n, dtype, backward),
        work=lambda n, dtype: (3 if backward else 2) * BENCH_ROWS * n * dtype.itemsize,
        dtypes=(torch.float16, torch.float32),
        quick_dtypes=(torch.float16,),  # fp32 compiles kernels of its own: recorded
        smoke_x=256,
        headline_x=4096,
        colors={"triton (lock)": "tab:blue", "triton (two-stage)": "tab:cyan"},
    )


forward = bench.run(benchmark("layer-norm-forward", backward=False))
backward = bench.run(benchmark("layer-norm-backward", backward=True))
ours, copy = "triton (two-stage)", bench.COPY_PROVIDER
DTYPES = ("float16", "float32")
for results in filter(None, (forward, backward)):
    peers = [p for p in results.providers() if not p.startswith("triton") and p != copy]
    sizes = sorted({p.x for p in results.points})
    cases = list(itertools.product(sizes, DTYPES))
    best = {(n, d): max(results.value(p, n, d) for p in peers) for n, d in cases}
    lead = {(n, d): results.value(ours, n, d) / best[n, d] for n, d in cases}
    share = {(n, d): results.ratio(ours, copy, n, d) for n, d in cases}
    print(f"{results.bench.name}, {ours}, against {', '.join(peers)} and a copy:")
    for d in DTYPES:
        ahead = sum(lead[n, d] >= 1 for n in sizes)
        low, high = (f(share[n, d] for n in sizes) for f in (min, max))
        print(
            f"  {d}: ahead of every peer at {ahead} of {len(sizes)} N; "
            f"{low:.0%} to {high:.0%} of a copy"
        )
    print("       N  over the best peer (fp16, fp32)  over a copy (fp16, fp32)")
    for n in sizes:
        print(
            f"  {n:>6,.0f}  {lead[n, 'float16']:>17.2f} {lead[n, 'float32']:>5.2f}"
            f"  {share[n, 'float16']:>18.0%} {share[n, 'float32']:>5.0%}"
        )
if backward is not None:
    cases = list(itertools.product(sorted({p.x for p in backward.points}), DTYPES))
    faster = sum(backward.ratio(ours, "triton (lock)", n, d) > 1 for n, d in cases)
    print(
        f"backward: two-stage faster than the lock at {faster} of {len(cases)} points"
    )

# %%
# Past ``FORWARD_MAX_BLOCK`` and ``BACKWARD_MAX_BLOCK`` rows are split over programs (chapter
# 13): read once, but a program waits for its row's other chunks, which costs most in fp16.
# The backward also writes and reads its partial sums, a larger share of the traffic the
# shorter the rows: in fp16 they keep N = 4,096 and 8,192 under 90% of a copy. Where the ratio
# to the best peer is under 1, a peer is ahead: in the forward on rows that fit a program,
# torch.compile or Liger-Kernel by a few percent. Our program holds its row in registers, 63
# to 80 a thread, so fewer warps share an SM than in torch.compile's kernel, which walks the
# row twice (the second time from L2) with 32 to 64; a kernel of ours that walks its row lost
# more than the extra warps gain. The providers are timed in turns (How we measure), so these
# gaps are not a drift of the GPU's clock. The two-stage reduction never waits for a lock:
# with its repeatability and the count above, it is the default. Dotted lines are calls from
# Python: up to N = 4,096 our calls' CPU time (in the tables) outlasts the kernels.
#
# What we learned
# ---------------
# * A row-wise kernel reads each row once; the variance of x - mean, from registers, is stable.
# * dW and dB are sums across programs: each program first sums many rows in registers.
# * A spin lock over plain stores needs a barrier before its release and release/acquire atomics.
# * A two-stage reduction, one partial row per program, gives the same bits on every run.
# * The launch rules and the limits above are measurements on an H100; ``lab/NOTES.md``
#   keeps the sweeps and profiles behind them.
#
# Exercises
# ---------
# 1. Delete ``tl.debug_barrier()`` from ``flush_partials`` and run the GPU race test of
#    ``tests/test_layer_norm.py`` a few times. Why can a pass not prove the barrier useless?
# 2. Replace the lock in ``flush_partials`` with ``tl.atomic_add``: speed? repeatability?
# 3. Fuse a residual addition into the forward (``layer_norm(x + residual)``, returning the sum
#    too). How many bytes does it save?
