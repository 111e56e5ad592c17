"""ops.softmax: the code of chapter 02, Fused softmax: one pass over memory, for rows of any
length."""

# Generated from tutorials/02-fused-softmax.py by tools/export.py: edit the chapter, then `make
# export`.

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
