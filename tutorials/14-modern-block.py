r"""
RMSNorm, rotary embeddings and SwiGLU: the layers of a modern decoder block
============================================================================

Llama, Mistral, Qwen, Gemma and their kin changed three layers of the GPT of chapter 12:
RMSNorm replaces layer normalization, rotary position embeddings (RoPE) turn the queries and
keys instead of adding a position to the input, and the MLP's activation is SwiGLU, a SiLU of
one projection times another. We write the three as Triton kernels, forward and backward,
behind functions that match PyTorch's and that ``torch.compile`` traces. What you will learn:

* what each layer must move, and how far eager PyTorch is from it;
* RMSNorm from layer norm's pieces: one reduction fewer, and dW summed over rows with the
  two-stage partial sums of chapter 03;
* RoPE as a rotation of pairs (i, i + D/2), its backward as the rotation by -sin, q and k
  rotated in one launch, read through the strides of a fused QKV projection;
* SwiGLU's product and its backward, and whether it pays to fuse it into the projection.

Prerequisites: chapter 03 (layer norm's backward), chapter 08 (``torch.library``), chapter 06
for an elementwise kernel's arithmetic. Without a GPU every cell runs under the interpreter.
"""

# %%
# Setup
# -----

import dataclasses

from stepkernels.lessons import bench, tutorial
from stepkernels.lessons.check_modern_block import as_tuple, check
from stepkernels.lessons.figures_modern_block import draw_rotary_programs
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

tutorial.announce()
DEVICE = tutorial.DEVICE
# sphinx_gallery_thumbnail_number = 1

# %%
# What the three layers compute, and what they must move
# ------------------------------------------------------
# A Llama block runs, for a residual stream x of M tokens by C features:
#
#     a = RMSNorm(x);  q, k, v = a Wq, a Wk, a Wv;  q, k = RoPE(q), RoPE(k)
#     h = x + attention(q, k, v) Wo;  b = RMSNorm(h)
#     out = h + (silu(b Wgate) * (b Wup)) Wdown
#
# The matmuls and the attention take most of the time (chapters 04 to 11). The three layers
# between them are elementwise or row-wise: their speed is their bytes. Counting elements of
# the input as passes over memory, the minimum is:
#
# * **RMSNorm**: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps). Forward: read x, write
#   y, 2 passes. Backward: read x and dy, write dx, 3 passes, and dW = sum over rows of
#   dy * x * rstd, which needs the programs to cooperate, as layer norm's dW did.
# * **RoPE** on q and k: read and write each once, 2 passes, plus cos and sin, one row per
#   position, shared by every batch and head. The backward is another rotation: 2 passes.
# * **SwiGLU's product** silu(gate) * up: read two, write one, 3 passes; the backward reads
#   dy, gate and up and writes two gradients, 5 passes.
#
# Eager PyTorch writes each intermediate: Hugging Face's ``rotate_half`` slices, negates and
# concatenates, then two products and a sum follow, about 10 passes where 2 suffice; ``silu``
# then ``*`` take 5 for 3. PyTorch's own ``rms_norm`` is one function call, whose passes the
# benchmark shows. So the ceiling is a copy of the same bytes, and eager RoPE a target several
# times below it.
#
# RMSNorm: the forward
# --------------------
# Layer norm without the mean: no centering, one sum of squares. A program normalizes a tile
# of ``ROWS_PER_PROGRAM`` rows of ``BLOCK_N`` columns held in registers, short rows packed
# several to a tile so that a program moves enough bytes, and keeps each row's rstd (4 bytes a
# row) for the backward. Rows longer than ``MAX_N`` do not fit in registers: the function
# refuses them (chapter 13 shows how to split a row over programs). The launch (values a
# program and a thread hold) is a small table by element size and call size, filled from a
# sweep on the GPU (``lab/modern_sweep.py``); the other kernels here have one too.

# @save ops/rms_norm
import functools
import math

from stepkernels.runtime.arguments import layer_norm_arguments
from stepkernels.runtime.core import (
    FLOAT_DTYPES,
    INTERPRET,
    refuse_double_backward,
    sm_count,
)
from stepkernels.runtime.device import profile
from stepkernels.runtime.launch import (  # cheap repeated launches: chapter 08
    cdiv,
    lean,
    next_power_of_2,
)
from stepkernels.runtime.rows import as_rows
import torch
from torch import Tensor
from torch.library import triton_op
import triton
import triton.language as tl


@lean
@triton.jit
def rms_norm_forward_kernel(
    x_ptr,
    y_ptr,
    weight_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    M,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)  # row * stride can pass 2**31
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask)
    x = x.to(tl.float32)  # masked lanes are 0: they add nothing to the sum
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(weight_ptr + cols, mask=col_mask).to(tl.float32)
    y_ptrs = y_ptr + rows64[:, None] * y_row_stride + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


MAX_N = 65536  # the longest row a program holds in registers
LARGE_FROM = 2**26  # elements from which a call takes the "large" launch
# Launches by (bytes an element, "small" or "large"), from lab/modern_sweep.py on an H200.
# Forward: values a program normalizes at least (short rows packed) and a thread holds.
FORWARD_LAUNCH = {
    (2, "small"): dict(tile=4096, per_thread=16),
    (2, "large"): dict(tile=4096, per_thread=32),
    (4, "small"): dict(tile=4096, per_thread=8),
    (4, "large"): dict(tile=4096, per_thread=32),
}


def launch_of(table: dict, n_elements: int, itemsize: int) -> dict:
    return table[min(itemsize, 4), "small" if n_elements < LARGE_FROM else "large"]


@functools.cache  # once per shape: off the call's path
def forward_config(n_cols: int, n_rows: int, itemsize: int) -> dict:
    launch = launch_of(FORWARD_LAUNCH, n_rows * n_cols, itemsize)
    block = next_power_of_2(n_cols)
    rows = max(1, min(launch["tile"] // block, next_power_of_2(n_rows)))
    warps = max(1, min(32, rows * block // (32 * launch["per_thread"])))
    return dict(BLOCK_N=block, ROWS_PER_PROGRAM=rows, num_warps=warps)


def rms_norm_forward(x2d: Tensor, weight: Tensor | None, eps: float):
    """y and rstd (fp32, one a row) of a 2-D ``x2d`` with contiguous rows."""
    (n_rows, n_cols), device = x2d.shape, x2d.device
    y = torch.empty((n_rows, n_cols), device=device, dtype=x2d.dtype)
    rstd = torch.empty(n_rows, device=device, dtype=torch.float32)
    if n_rows == 0:
        return y, rstd
    config = forward_config(n_cols, n_rows, x2d.element_size())
    grid = (cdiv(n_rows, config["ROWS_PER_PROGRAM"]),)
    rms_norm_forward_kernel[grid](
        x2d,
        y,
        x2d if weight is None else weight,
        rstd,
        x2d.stride(0),
        y.stride(0),
        n_rows,
        n_cols,
        eps,
        HAS_WEIGHT=weight is not None,
        **config,
    )
    return y, rstd


# %%
# The backward
# ------------
# With x_hat = x * rstd and g = w * dy, the derivative of y = x_hat * w through rstd gives
#
#     dx = rstd * (g - x_hat * c),   c = sum(x_hat * g) / N,   dW = sum over rows of dy * x_hat
#
# layer norm's dx without its second constant (the mean's). A program walks
# ``rows_per_program`` rows, loads of the next row issued before this row's arithmetic, and
# sums ``dy * x_hat`` in registers. It stores them as one partial row of dW, N fp32 values,
# which a second kernel adds in a fixed order, so dW has the same bits every run (chapter 03's
# two-stage reduction; its ``flush_partials`` writes (dW, dB) pairs, and RMSNorm has no dB).
# At N = 4,096 and 2 programs an SM, that is 4 MB written and read again beside the 96 MB of
# a 2^24-element bf16 backward.


# @save ops/rms_norm
@lean
@triton.jit
def rms_norm_backward_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    weight_ptr,
    rstd_ptr,
    partial_ptr,
    x_row_stride,
    dy_row_stride,
    dx_row_stride,
    M,
    N,
    rows_per_program,  # not a constexpr: one compile serves every number of rows
    BLOCK_N: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WANT_DW: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    program_id = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask).to(tl.float32)
    dw = tl.zeros([BLOCK_N], tl.float32)
    for i in tl.range(rows_per_program, num_stages=NUM_STAGES):
        row = program_id * rows_per_program + i
        mask, row64 = cols < tl.where(row < M, N, 0), row.to(tl.int64)
        x = tl.load(x_ptr + row64 * x_row_stride + cols, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + row64 * dy_row_stride + cols, mask=mask, other=0.0)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, M - 1))  # rows past M: dy = 0
        x_hat = x * rstd
        g = w * dy if HAS_WEIGHT else dy
        c = tl.sum(x_hat * g, axis=0) / N
        dx = (g - x_hat * c) * rstd
        dx_ptrs = dx_ptr + row64 * dx_row_stride + cols
        tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    if WANT_DW:  # a partial row of dW a program, summed by the next kernel
        tl.store(partial_ptr + program_id.to(tl.int64) * N + cols, dw, mask=col_mask)


@lean
@triton.jit
def sum_weight_partials_kernel(
    partial_ptr, dw_ptr, num_partials, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):
    """dW = the sum of the partial rows, in a fixed order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for first in tl.range(0, num_partials, BLOCK_P):
        slots = first + tl.arange(0, BLOCK_P)
        mask = (slots < num_partials)[:, None] & col_mask[None, :]
        ptrs = partial_ptr + slots.to(tl.int64)[:, None] * N + cols[None, :]
        dw += tl.load(ptrs, mask=mask, other=0.0)
    dw_sum = tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty)  # one rounding
    tl.store(dw_ptr + cols, dw_sum, mask=col_mask)


# Backward: programs an SM (fewer: fewer partial rows; more: more rows in flight), loads of
# rows in flight (NUM_STAGES, within the shared memory) and values a thread holds of a row.
BACKWARD_LAUNCH = {
    (2, "small"): dict(programs_per_sm=2, stages=3, per_thread=32),
    (2, "large"): dict(programs_per_sm=1, stages=4, per_thread=16),
    (4, "small"): dict(programs_per_sm=1, stages=3, per_thread=32),
    (4, "large"): dict(programs_per_sm=2, stages=2, per_thread=16),
}


@functools.cache
def backward_config(n_cols: int, n_rows: int, itemsize: int) -> tuple[int, dict]:
    """Rows a program and the kernel's launch."""
    launch = launch_of(BACKWARD_LAUNCH, n_rows * n_cols, itemsize)
    block = next_power_of_2(n_cols)
    programs = 4 if INTERPRET else launch["programs_per_sm"] * sm_count()  # CPU: few
    rows = min(256, cdiv(n_rows, programs))  # at most ``programs`` programs
    in_flight = (profile().shared_memory - 1024) // (2 * block * itemsize)
    stages = max(1, min(launch["stages"], in_flight))  # x and dy rows a stage
    warps = max(4, min(16, block // (32 * launch["per_thread"])))
    return rows, dict(BLOCK_N=block, NUM_STAGES=stages, num_warps=warps)


def rms_norm_backward(dy2d, x2d, weight, rstd, want_dw: bool):
    """dx, and dW (None unless wanted), for 2-D ``dy2d`` and ``x2d`` with contiguous
    rows."""
    (n_rows, n_cols), device = x2d.shape, x2d.device
    dx = torch.empty((n_rows, n_cols), device=device, dtype=x2d.dtype)
    dw = torch.empty(n_cols, device=device, dtype=weight.dtype) if want_dw else None
    if n_rows == 0:  # a sum over no rows
        return dx, None if dw is None else dw.zero_()
    rows_per_program, config = backward_config(n_cols, n_rows, x2d.element_size())
    n_programs = cdiv(n_rows, rows_per_program)
    partials = dx  # never touched without dW
    if want_dw:
        partials = torch.empty((n_programs, n_cols), device=device)
    rms_norm_backward_kernel[(n_programs,)](
        x2d,
        dy2d,
        dx,
        x2d if weight is None else weight,
        rstd,
        partials,
        x2d.stride(0),
        dy2d.stride(0),
        dx.stride(0),
        n_rows,
        n_cols,
        rows_per_program,
        HAS_WEIGHT=weight is not None,
        WANT_DW=want_dw,
        **config,
    )
    if want_dw:  # narrow column blocks, the partials of one loaded together
        block_n = min(128, max(16, next_power_of_2(n_cols // sm_count() or 1)))
        block_p = min(next_power_of_2(n_programs), max(16, 4096 // block_n))
        sum_weight_partials_kernel[(cdiv(n_cols, block_n),)](
            partials, dw, n_programs, n_cols, BLOCK_P=block_p, BLOCK_N=block_n
        )
    return dx, dw


# %%
# The function, the module, and the operators for ``torch.compile``
# -----------------------------------------------------------------
# ``rms_norm`` takes ``torch.nn.functional.rms_norm``'s arguments, with the same default eps:
# the machine epsilon of the dtype PyTorch computes in, fp32 for every dtype here (not fp16's,
# 1,000 times larger). Its checks are layer norm's (``runtime.arguments``). As in chapter 08,
# the kernels are also two ``torch.library.triton_op`` operators with their autograd
# registered, which ``torch.compile`` traces without a graph break; an eager call goes through
# the ``autograd.Function`` instead, a few microseconds of CPU cheaper.


# @save ops/rms_norm
@triton_op("stepkernels::rms_norm_forward", mutates_args={})
def rms_norm_forward_op(
    x2d: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    return rms_norm_forward(x2d, weight, eps)  # y, rstd


@triton_op("stepkernels::rms_norm_backward", mutates_args={})
def rms_norm_backward_op(
    dy2d: Tensor, x2d: Tensor, weight: Tensor | None, rstd: Tensor, want_dw: bool
) -> tuple[Tensor, Tensor]:
    dx, dw = rms_norm_backward(dy2d, x2d, weight, rstd, want_dw)
    return dx, x2d.new_empty(0) if dw is None else dw  # an operator returns tensors


def save_for_backward(ctx, inputs, output):
    x2d, weight, _ = inputs
    ctx.save_for_backward(x2d, weight, output[1])
    ctx.set_materialize_grads(False)  # rstd gets no gradient


def rms_norm_grads(ctx, dy, *_, backward=rms_norm_backward_op):
    refuse_double_backward("rms_norm", "torch.nn.functional.rms_norm")
    x2d, weight, rstd = ctx.saved_tensors
    want_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw = backward(as_rows(dy), x2d, weight, rstd, want_dw)
    return dx, dw if want_dw else None, None


rms_norm_forward_op.register_autograd(rms_norm_grads, setup_context=save_for_backward)


class RMSNormFunction(torch.autograd.Function):
    """The same forward and backward without the operators, for eager calls."""

    @staticmethod
    def forward(ctx, x2d, weight, eps):
        output = rms_norm_forward(x2d, weight, eps)
        save_for_backward(ctx, (x2d, weight, eps), output)
        return output

    @staticmethod
    def backward(ctx, dy, _rstd_grad):
        return rms_norm_grads(ctx, dy, backward=rms_norm_backward)


def rms_norm_arguments(x, normalized_shape, weight, eps):
    """``normalized_shape`` as a tuple and eps as a float, once the arguments pass."""
    if eps is None and isinstance(x, torch.Tensor):  # PyTorch's default: fp32's epsilon
        eps = torch.finfo(torch.float32).eps
    given = (x, normalized_shape, weight, None, 0.0 if eps is None else eps)
    shape = layer_norm_arguments(
        *given, "two-stage", None, FLOAT_DTYPES, ("two-stage",)
    )
    if math.prod(shape) > MAX_N:
        raise ValueError(
            f"normalized_shape {shape} holds {math.prod(shape):,} values a row; rms_norm "
            f"takes at most {MAX_N:,}: use torch.nn.functional.rms_norm for longer rows"
        )
    return shape, float(eps)


def rms_norm(x, normalized_shape, weight=None, eps=None):
    """``torch.nn.functional.rms_norm`` in Triton: ``x * rsqrt(mean(x^2) + eps) * weight``
    over the trailing ``normalized_shape`` dimensions; eps None is PyTorch's default."""
    shape, eps = rms_norm_arguments(x, normalized_shape, weight, eps)  # or raises
    x2d = as_rows(x if len(shape) == 1 else x.flatten(-len(shape)))
    weight = None if weight is None else weight.reshape(-1).contiguous()
    if torch.compiler.is_compiling():
        y = rms_norm_forward_op(x2d, weight, eps)[0]
    elif torch.is_grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad)
    ):
        y = RMSNormFunction.apply(x2d, weight, eps)[0]
    else:  # nothing for autograd
        y = rms_norm_forward(x2d, weight, eps)[0]
    return y.view(x.shape)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` on these kernels: same arguments, parameters and state dict."""

    def forward(self, x):
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


# %%
# Correctness
# -----------
# ``check`` (``stepkernels.lessons.check_modern_block``) compares y, dx and dW with the same
# computation in fp64 for each dtype, within one rounding of the dtype: a single row, rows that
# are not a power of two, two normalized dimensions, rows 2N apart (a slice, used as it is),
# an fp32 weight with a 16-bit x (as mixed precision keeps them), and no weight.


def rms_reference(x, shape, weight=None, eps=None):
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    dims = tuple(range(-len(shape), 0))
    y = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    return y if weight is None else y * weight


rows = bench.choose(gpu=4096, cpu=19)
grad = lambda t: t.requires_grad_()
check(
    "rms_norm",
    lambda x, shape, w: rms_norm(x, shape, w),
    rms_reference,
    {
        "one row": lambda r, d: (grad(r(1, 300)), (300,), grad(r(300))),
        "odd rows": lambda r, d: (grad(r(rows, 781)), (781,), grad(r(781))),
        "two dims": lambda r, d: (grad(r(4, 6, 10)), (6, 10), grad(r(6, 10))),
        "a slice": lambda r, d: (grad(r(16, 200))[:, :100], (100,), grad(r(100))),
        "fp32 weight": lambda r, d: (
            grad(r(5, 64)),
            (64,),
            grad(r(64, dtype=torch.float32)),
        ),
        "no weight": lambda r, d: (grad(r(7, 96)), (96,), None),
    },
)

# %%
# Rotary position embeddings
# --------------------------
# RoPE (Su et al., 2021) turns each pair of a head's D features by an angle that grows with
# the position: the product of a query at position m and a key at position n then depends on
# m - n alone. Hugging Face's Llama pairs feature i with i + D/2 ("rotate half"): with x1 and x2
# the two halves, and cos and sin of shape (N, D) (the angles of a position, repeated over the
# halves),
#
#     y = x * cos + rotate_half(x) * sin,   rotate_half(x) = [-x2, x1]
#     y1 = x1 cos1 - x2 sin1,   y2 = x2 cos2 + x1 sin2
#
# y is linear in x, so dx is the transposed map applied to dy: dx1 = dy1 cos1 + dy2 sin2 and
# dx2 = dy2 cos2 - dy1 sin1. Where the halves of sin are equal (always, for RoPE's), that is
# the same rotation by -sin: the backward is the forward's kernel with two signs changed.
#
# A program takes a block of positions of one sequence, loads their cos and sin once, and turns
# them for every head of q, then of k: the tables, as large as one head of q, are read once
# per sequence rather than once per head. (A first version, a program per block of rows of one
# head, reread them for each head, and moved bytes at 52% to 63% of a copy's rate on an H100.)
# Where positions are too few to fill the GPU, the heads are split over programs too.
# Queries and keys usually come out of one projection, (B, N, 3, H, D) viewed as q, k, v of
# shape (B, H, N, D): we read them through their strides, (N * 3HD, D, 3HD, 1), without a copy.
# Rotating q and k in one launch saves a launch, and its CPU time (chapter 08), and reads the
# tables once for both. Drawn for 6 heads of q and 2 of k:

draw_rotary_programs()

# %%
# @save ops/rotary
from stepkernels.runtime.arguments import parameter_dtype
from stepkernels.runtime.core import (
    FLOAT_DTYPES,
    check_tensor,
    refuse_autograd,
    refuse_double_backward,
    sm_count,
)
from stepkernels.runtime.launch import cdiv, lean, next_power_of_2
import torch
from torch import Tensor
from torch.library import triton_op
import triton
import triton.language as tl


@triton.jit
def rotate_head(x, y, tables, mask, HALF):
    """One head's tile: x and y point at the first halves of its rows, in and out."""
    cos1, cos2, sin1, sin2 = tables
    x1 = tl.load(x, mask=mask).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask).to(tl.float32)
    y1, y2 = x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2
    tl.store(y, y1.to(y.dtype.element_ty), mask=mask)
    tl.store(y + HALF, y2.to(y.dtype.element_ty), mask=mask)


@lean
@triton.jit
def rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    q_batch_stride,
    q_head_stride,
    q_position_stride,
    k_batch_stride,
    k_head_stride,
    k_position_stride,
    cos_stride,
    q_heads,
    k_heads,
    seq_len,
    heads_per_program,
    HALF,
    BLOCK_POSITIONS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BACKWARD: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    position_blocks = tl.cdiv(seq_len, BLOCK_POSITIONS)
    batch = (tl.program_id(0) // position_blocks).to(tl.int64)
    positions = (tl.program_id(0) % position_blocks) * BLOCK_POSITIONS
    positions = (positions + tl.arange(0, BLOCK_POSITIONS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (positions < seq_len)[:, None] & (cols < HALF)[None, :]
    # The angles of these positions, once for every head this program turns
    angle = positions[:, None] * cos_stride + cols[None, :]
    cos1 = tl.load(cos_ptr + angle, mask=mask).to(tl.float32)
    cos2 = tl.load(cos_ptr + angle + HALF, mask=mask).to(tl.float32)
    sin1 = tl.load(sin_ptr + angle, mask=mask).to(tl.float32)
    sin2 = tl.load(sin_ptr + angle + HALF, mask=mask).to(tl.float32)
    # The backward, the transposed map: dx1 = dy1 cos1 + dy2 sin2, dx2 = dy2 cos2 - dy1 sin1
    if BACKWARD:
        sin1, sin2 = -sin2, -sin1
    tables = (cos1, cos2, sin1, sin2)
    y_cols = positions[:, None] * (2 * HALF) + cols[None, :]  # the outputs: contiguous
    first = tl.program_id(1) * heads_per_program
    last = tl.minimum(first + heads_per_program, q_heads + k_heads)
    x_cols = positions[:, None] * q_position_stride + cols[None, :]
    for head in tl.range(first, tl.minimum(last, q_heads), num_stages=NUM_STAGES):
        x = q_ptr + batch * q_batch_stride + tl.cast(head, tl.int64) * q_head_stride
        y = q_out_ptr + (batch * q_heads + head) * seq_len * (2 * HALF)
        rotate_head(x + x_cols, y + y_cols, tables, mask, HALF)
    x_cols = positions[:, None] * k_position_stride + cols[None, :]
    for head in tl.range(
        tl.maximum(first, q_heads) - q_heads, last - q_heads, num_stages=NUM_STAGES
    ):
        x = k_ptr + batch * k_batch_stride + tl.cast(head, tl.int64) * k_head_stride
        y = k_out_ptr + (batch * k_heads + head) * seq_len * (2 * HALF)
        rotate_head(x + x_cols, y + y_cols, tables, mask, HALF)


# Launches by (bytes an element, "small" or "large": from 2^26 elements of q and k), from
# lab/modern_sweep.py on an H200: values of a head a program rotates at once (its positions),
# programs an SM (heads are split over programs where positions are too few), warps, and
# loads of heads in flight (NUM_STAGES, 1: none ahead).
ROTARY_LAUNCH = {
    (2, "small"): dict(tile=2048, programs_per_sm=16, warps=4, stages=1),
    (2, "large"): dict(tile=2048, programs_per_sm=8, warps=4, stages=1),
    (4, "small"): dict(tile=4096, programs_per_sm=16, warps=8, stages=1),
    (4, "large"): dict(tile=4096, programs_per_sm=4, warps=8, stages=1),
}
LARGE_FROM = 2**26


def rotary_launch(batch: int, heads: int, seq_len: int, half: int, itemsize: int):
    """The grid, heads a program and launch of ``rotary_kernel`` for heads of q and k."""
    size = "small" if batch * heads * seq_len * 2 * half < LARGE_FROM else "large"
    launch = ROTARY_LAUNCH[min(itemsize, 4), size]
    block_half = next_power_of_2(half)
    tile_positions = launch["tile"] // (2 * block_half)
    positions = max(1, min(tile_positions, next_power_of_2(seq_len)))
    position_programs = batch * cdiv(seq_len, positions)
    wanted = cdiv(launch["programs_per_sm"] * sm_count(), position_programs)
    heads_per_program = cdiv(heads, min(heads, wanted))
    grid = (position_programs, cdiv(heads, heads_per_program))
    meta = dict(BLOCK_POSITIONS=positions, BLOCK_HALF=block_half)
    meta.update(NUM_STAGES=launch["stages"], num_warps=launch["warps"])
    return grid, heads_per_program, meta


def last_stride_one(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rotate(q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, backward: bool):
    """q and k (or q alone, k None) rotated, each into a new contiguous tensor, in one
    launch; ``backward``: the transposed rotation."""
    q, cos, sin = last_stride_one(q), last_stride_one(cos), last_stride_one(sin)
    if cos.stride() != sin.stride():  # one stride for both tables
        cos, sin = cos.contiguous(), sin.contiguous()
    k = None if k is None else last_stride_one(k)
    q_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    k_out = None if k is None else torch.empty(k.shape, device=k.device, dtype=k.dtype)
    (batch, q_heads, seq_len, dim), half = q.shape, q.shape[-1] // 2
    heads = q_heads + (0 if k is None else k.shape[1])
    if batch * heads * seq_len * dim == 0:  # nothing to rotate
        return q_out, k_out
    grid, heads_per_program, meta = rotary_launch(
        batch, heads, seq_len, half, q.element_size()
    )
    k_given = q if k is None else k
    rotary_kernel[grid](
        q,
        k_given,
        q_out,
        q_out if k is None else k_out,
        cos,
        sin,
        *q.stride()[:3],
        *k_given.stride()[:3],
        cos.stride(0),
        q_heads,
        heads - q_heads,
        seq_len,
        heads_per_program,
        half,
        BACKWARD=backward,
        **meta,
    )
    return q_out, k_out


# %%
# The autograd function and the operator follow chapter 08's pattern; ``rotary_embedding``
# rotates one tensor, ``rotary_embedding_qk`` two in one launch. cos and sin get no gradient
# (they are a table of the positions), so inputs that ask for one are refused.


# @save ops/rotary
@triton_op("stepkernels::rotary", mutates_args={})
def rotary_op(
    q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, backward: bool
) -> tuple[Tensor, Tensor]:
    q_out, k_out = rotate(q, k, cos, sin, backward)
    return q_out, q.new_empty(0) if k_out is None else k_out


def save_tables(ctx, inputs, output):
    _, k, cos, sin, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.has_k = k is not None


def rotary_grads(ctx, dq, dk, rotation=rotary_op):
    refuse_double_backward("rotary_embedding", "x * cos + rotate_half(x) * sin")
    cos, sin = ctx.saved_tensors
    dq, dk = rotation(dq, dk if ctx.has_k else None, cos, sin, True)
    return dq, dk if ctx.has_k else None, None, None, None


rotary_op.register_autograd(rotary_grads, setup_context=save_tables)


class RotaryFunction(torch.autograd.Function):
    """The same forward and backward without the operator, for eager calls."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, backward):
        save_tables(ctx, (q, k, cos, sin, backward), None)
        return rotate(q, k, cos, sin, backward)

    @staticmethod
    def backward(ctx, dq, dk):
        return rotary_grads(ctx, dq, dk, rotation=rotate)


def rotary_arguments(tensors: dict, cos, sin) -> None:
    """(B, H, N, D) tensors of one float dtype, D even, with the same B, N and D; cos and
    sin (N, D) in their dtype or fp32, needing no gradient."""
    first = next(iter(tensors.values()))
    for name, x in tensors.items():
        check_tensor(x, name, FLOAT_DTYPES)
        if x.dim() != 4 or x.shape[-1] % 2:
            raise ValueError(
                f"{name} must be (batch, heads, positions, head_dim) with an even "
                f"head_dim, got shape {tuple(x.shape)}: for (batch, positions, heads, "
                f"head_dim) pass {name}.transpose(1, 2)"
            )
        if x.dtype != first.dtype:
            raise TypeError(f"{name} is {x.dtype} but q is {first.dtype}: convert one")
        if (x.shape[0], *x.shape[2:]) != (first.shape[0], *first.shape[2:]):
            raise ValueError(
                f"{name} {tuple(x.shape)} and q {tuple(first.shape)} differ in batch, "
                "positions or head_dim: only their heads may differ"
            )
    wanted = (first.shape[2], first.shape[3])
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(table, name, FLOAT_DTYPES)
        parameter_dtype(name, table, first, fp32_too=True)
        if table.shape != wanted:
            raise ValueError(
                f"{name} must be (positions, head_dim) = {wanted}, got "
                f"{tuple(table.shape)}: for Hugging Face's (1, N, D) pass {name}[0]"
            )
    alternative = "x * cos + rotate_half(x) * sin in PyTorch"
    refuse_autograd("rotary_embedding for cos and sin", alternative, cos, sin)


def rotary(q, k, cos, sin):
    grads = torch.is_grad_enabled() and (
        q.requires_grad or (k is not None and k.requires_grad)
    )
    if torch.compiler.is_compiling():
        q_out, k_out = rotary_op(q, k, cos, sin, False)
    elif grads:
        q_out, k_out = RotaryFunction.apply(q, k, cos, sin, False)
    else:
        q_out, k_out = rotate(q, k, cos, sin, False)
    return q_out, k_out


def rotary_embedding(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` (Hugging Face's Llama) for x of shape (B, H, N, D)
    and cos, sin of shape (N, D); a new contiguous tensor."""
    rotary_arguments({"x": x}, cos, sin)
    return rotary(x, None, cos, sin)[0]


def rotary_embedding_qk(q, k, cos, sin):
    """``rotary_embedding`` of q and of k in one launch: (q rotated, k rotated). k may
    have fewer heads than q (grouped-query attention); both may be strided views."""
    rotary_arguments({"q": q, "k": k}, cos, sin)
    return rotary(q, k, cos, sin)


ROPE_BASE = 10000.0  # the angles' base (RoFormer's and Llama's)


def rope_tables(positions, dim, dtype=torch.float32, device=None, base=ROPE_BASE):
    """cos and sin (positions, dim): position m turns the pair (i, i + dim/2) by
    m x base^(-2i / dim), the angles repeated over the two halves; computed in fp64,
    rounded once to ``dtype``."""
    steps = torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim
    places = torch.arange(positions, device=device, dtype=torch.float64)
    angles = places[:, None] * base**-steps
    angles = torch.cat([angles, angles], dim=-1)  # the halves repeat
    return angles.cos().to(dtype), angles.sin().to(dtype)


# %%
# The check runs each function against ``q * cos + rotate_half(q) * sin`` in fp64, forward
# and backward: q, k and v as views of one projection, a head_dim of 6 (a half of 3, not a
# power of two), grouped heads, and cos and sin in fp32 beside 16-bit q and k.


def rope_reference(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def fused_qkv(r, batch, positions, heads, dim):
    qkv = grad(r(batch, positions, 3 * heads * dim))
    return qkv.view(batch, positions, 3, heads, dim).permute(2, 0, 3, 1, 4)


def rope_case(batch, q_heads, k_heads, positions, dim, fused=False, fp32=False):
    def make(r, dtype):
        tables = rope_tables(positions, dim, torch.float32 if fp32 else dtype, DEVICE)
        if fused:
            q, k, _ = fused_qkv(r, batch, positions, q_heads, dim)
        else:
            q = grad(r(batch, q_heads, positions, dim))
            k = grad(r(batch, k_heads, positions, dim))
        return q, k, *tables

    return make


positions = bench.choose(gpu=2048, cpu=37)
rope_cases = {
    "one position": rope_case(1, 2, 2, 1, 8),
    "odd sizes": rope_case(2, 3, 1, positions, 64),
    "head_dim 6": rope_case(1, 2, 2, 5, 6),
    "views of qkv": rope_case(2, 4, 4, positions, 32, fused=True),
    "fp32 tables": rope_case(1, 4, 2, 9, 16, fp32=True),
}
qk_reference = lambda q, k, c, s: (rope_reference(q, c, s), rope_reference(k, c, s))
check("rotary_embedding_qk", rotary_embedding_qk, qk_reference, rope_cases)
without_k = lambda q, k, cos, sin: (q, cos, sin)
single = {
    name: lambda r, d, make=make: without_k(*make(r, d))
    for name, make in rope_cases.items()
}
check("rotary_embedding", rotary_embedding, rope_reference, single)

# %%
# SwiGLU's product
# ----------------
# Llama's MLP is ``down(silu(gate(x)) * up(x))``, silu(g) = g sigmoid(g) (Shazeer, 2020). The
# product and its backward are elementwise, with s = sigmoid(g):
#
#     y = g s u,   du = dy g s,   dg = dy u s (1 + g (1 - s))
#
# A program takes a tile of ``BLOCK_ROWS`` rows by ``BLOCK_COLS`` columns, each operand at its
# own row stride: gate and up are often the two halves of one projection's output, (M, 2F)
# split into two (M, F) views 2F apart, which we read as they are. Rows of any layout
# become rows through ``runtime.rows.as_rows`` (chapter 02), which copies only when a row's
# values are not adjacent. The forward keeps nothing but its inputs.

# @save ops/swiglu
from stepkernels.runtime.core import FLOAT_DTYPES, check_tensor, refuse_double_backward
from stepkernels.runtime.launch import cdiv, lean, next_power_of_2
from stepkernels.runtime.rows import as_rows
import torch
from torch import Tensor
from torch.library import triton_op
import triton
import triton.language as tl


@triton.jit
def tile(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """This program's tile: rows [R, 1] (int64), columns [1, C], and its mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows[:, None], cols[None, :], mask


@lean
@triton.jit
def silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    gate_row_stride,
    up_row_stride,
    n_rows,
    n_cols,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows, cols, mask = tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    g = tl.load(gate_ptr + rows * gate_row_stride + cols, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + rows * up_row_stride + cols, mask=mask).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(
        out_ptr + rows * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask
    )


@lean
@triton.jit
def silu_mul_backward_kernel(
    dy_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    dy_row_stride,
    gate_row_stride,
    up_row_stride,
    n_rows,
    n_cols,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows, cols, mask = tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    dy = tl.load(dy_ptr + rows * dy_row_stride + cols, mask=mask).to(tl.float32)
    g = tl.load(gate_ptr + rows * gate_row_stride + cols, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + rows * up_row_stride + cols, mask=mask).to(tl.float32)
    at_grad = rows * n_cols + cols  # the gradients: contiguous
    s = tl.sigmoid(g)
    dgate = dy * u * s * (1.0 + g * (1.0 - s))
    tl.store(dgate_ptr + at_grad, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    dup = dy * g * s
    tl.store(dup_ptr + at_grad, dup.to(dup_ptr.dtype.element_ty), mask=mask)


# Launches by (kernel, bytes an element, "small" or "large": from 2^26 elements), from
# lab/modern_sweep.py on an H200: values a program takes, and warps.
SWIGLU_LAUNCH = {
    ("forward", 2, "small"): dict(tile=8192, warps=16),
    ("forward", 2, "large"): dict(tile=8192, warps=16),
    ("forward", 4, "small"): dict(tile=8192, warps=16),
    ("forward", 4, "large"): dict(tile=8192, warps=16),
    ("backward", 2, "small"): dict(tile=4096, warps=4),
    ("backward", 2, "large"): dict(tile=4096, warps=4),
    ("backward", 4, "small"): dict(tile=4096, warps=4),
    ("backward", 4, "large"): dict(tile=8192, warps=16),
}
LARGE_FROM = 2**26


def swiglu_launch(n_rows: int, n_cols: int, itemsize: int, kernel: str):
    size = "small" if n_rows * n_cols < LARGE_FROM else "large"
    launch = SWIGLU_LAUNCH[kernel, min(itemsize, 4), size]
    block_cols = min(launch["tile"], next_power_of_2(n_cols))
    block_rows = min(launch["tile"] // block_cols, next_power_of_2(n_rows))
    grid = (cdiv(n_rows, block_rows), cdiv(n_cols, block_cols))
    meta = dict(BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=launch["warps"])
    return meta, grid


def rows_of(t: Tensor) -> Tensor:
    return as_rows(t) if t.dim() else t.reshape(1, 1)


def silu_mul_forward(gate: Tensor, up: Tensor) -> Tensor:
    out = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    if out.numel():  # an empty tensor may have no rows to view it as
        g2d, u2d = rows_of(gate), rows_of(up)
        meta, grid = swiglu_launch(*g2d.shape, gate.element_size(), "forward")
        strides = (g2d.stride(0), u2d.stride(0))
        silu_mul_kernel[grid](g2d, u2d, out, *strides, *g2d.shape, **meta)
    return out


def silu_mul_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    dgate, dup = (
        torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (gate, up)
    )
    if dy.numel():
        dy2d, g2d, u2d = rows_of(dy), rows_of(gate), rows_of(up)
        meta, grid = swiglu_launch(*g2d.shape, gate.element_size(), "backward")
        strides = (dy2d.stride(0), g2d.stride(0), u2d.stride(0))
        tensors = (dy2d, g2d, u2d, dgate, dup)
        silu_mul_backward_kernel[grid](*tensors, *strides, *g2d.shape, **meta)
    return dgate, dup


@triton_op("stepkernels::silu_mul_forward", mutates_args={})
def silu_mul_forward_op(gate: Tensor, up: Tensor) -> Tensor:
    return silu_mul_forward(gate, up)


@triton_op("stepkernels::silu_mul_backward", mutates_args={})
def silu_mul_backward_op(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return silu_mul_backward(dy, gate, up)


def save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def silu_mul_grads(ctx, dy, backward=silu_mul_backward_op):
    refuse_double_backward("silu_mul", "torch.nn.functional.silu(gate) * up")
    return backward(dy, *ctx.saved_tensors)


silu_mul_forward_op.register_autograd(silu_mul_grads, setup_context=save_inputs)


class SiluMulFunction(torch.autograd.Function):
    """The same forward and backward without the operators, for eager calls."""

    @staticmethod
    def forward(ctx, gate, up):
        save_inputs(ctx, (gate, up), None)
        return silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        return silu_mul_grads(ctx, dy, backward=silu_mul_backward)


def silu_mul(gate, up):
    """``torch.nn.functional.silu(gate) * up``, SwiGLU's product, in one kernel: gate and
    up of one shape and float dtype, at any strides (the halves of one projection's
    output are read in place); a new contiguous tensor."""
    for name, t in (("gate", gate), ("up", up)):
        check_tensor(t, name, FLOAT_DTYPES)
    if up.dtype != gate.dtype:
        raise TypeError(f"up is {up.dtype} but gate is {gate.dtype}: convert one")
    if up.shape != gate.shape:
        raise ValueError(
            f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape: "
            "for one projection's output h of 2F features pass h.chunk(2, dim=-1)"
        )
    if torch.compiler.is_compiling():
        return silu_mul_forward_op(gate, up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return SiluMulFunction.apply(gate, up)
    return silu_mul_forward(gate, up)


# %%
# The check: odd shapes, a 0-dim pair, and gate and up as the two halves of one tensor.


def halves(r, shape):
    both = grad(r(*shape[:-1], 2 * shape[-1]))
    return both.chunk(2, dim=-1)


swiglu_rows = bench.choose(gpu=4096, cpu=19)
check(
    "silu_mul",
    silu_mul,
    lambda g, u: F.silu(g) * u,
    {
        "one value": lambda r, d: (grad(r()), grad(r())),
        "odd shape": lambda r, d: (
            grad(r(3, swiglu_rows, 37)),
            grad(r(3, swiglu_rows, 37)),
        ),
        "halves of one tensor": lambda r, d: halves(r, (swiglu_rows, 300)),
        "long rows": lambda r, d: (grad(r(2, 5000)), grad(r(2, 5000))),
    },
)

# %%
# Does SwiGLU's product belong in the projection's epilogue?
# ----------------------------------------------------------
# Chapter 05's fused linear applies an activation to a matmul's tile before it stores it. If
# the weight's rows are interleaved so that a tile holds the gate and up columns of the same
# features, the epilogue could store silu(g) * u alone. What that saves is the product's own
# traffic, which we compare with the projection's time, for M tokens, C features and F of the
# MLP, at an H100's dense bf16 rate (989 TFLOP/s) and copy bandwidth (3.35 TB/s, nominal):
# unfused, the forward writes g and u, reads them and writes the product, 5 M F elements
# where the fused epilogue writes M F. The backward needs g and u (or the projection again):
# a fused forward that stores them for it writes 3 M F, and saves 2 M F.

M_TOKENS, C, F_MLP = 8192, 4096, 14336  # Llama 3 8B's widths
projection_s = 2 * M_TOKENS * C * 2 * F_MLP / 989e12
for label, elements in (("forward alone", 4), ("keeping g and u for the backward", 2)):
    saved_s = elements * M_TOKENS * F_MLP * 2 / 3.35e12  # bf16
    print(
        f"fused, {label}: {saved_s * 1e6:.0f} µs saved of {projection_s * 1e6:.0f} µs "
        f"of projection ({saved_s / projection_s:.0%})"
    )

# %%
# In training, where the backward needs g and u, the fusion saves a few percent of the
# projection at best, and costs a matmul with an interleaved weight, whose backward then has
# its own epilogue (dg, du) to fuse. Liger-Kernel keeps the product as its own kernel, as we
# do; the bytes it moves are the ones to make fast. For inference, which keeps nothing, the
# saving is larger (printed above) and the fusion is worth having (exercise 3).
#
# Refusals
# --------
# Each function refuses input it cannot take before a kernel runs: a TypeError for a wrong
# type or dtype, a ValueError for a wrong shape or value, saying what to do.

x = torch.randn(4, 64, device=DEVICE)
q = torch.randn(1, 2, 8, 16, device=DEVICE)
cos, sin = rope_tables(8, 16, device=DEVICE)
tutorial.show_refusals(
    "the block's layers",
    {
        "rms_norm, fp64": lambda: rms_norm(x.double(), (64,)),
        "rms_norm, shape": lambda: rms_norm(x, (32,)),
        "rotary, odd D": lambda: rotary_embedding(
            q[..., :15], cos[:, :15], sin[:, :15]
        ),
        "rotary, (1, N, D)": lambda: rotary_embedding(q, cos[None], sin[None]),
        "rotary, int": lambda: rotary_embedding(q.int(), cos, sin),
        "silu_mul, shapes": lambda: silu_mul(x, x[:, :32]),
    },
)

# %%
# Benchmarks
# ----------
# From 2^24 to 2^27 elements, forward and forward + backward, in bf16 and fp32, against eager
# PyTorch, ``torch.compile`` and Liger-Kernel where installed, with a copy of the same bytes
# as the limit. RMSNorm on rows of 4,096 features: 2 passes forward, 5 with the backward.
# RoPE on q of 32 heads and k of 8 (grouped-query attention, head_dim 128; the x axis counts
# q's elements): 2 passes of q and k forward, 4 with the backward, cos and sin aside. The
# product on rows of 8,192: 3 passes forward, 8 with the backward.

try:  # Liger-Kernel, where installed
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
except ImportError:
    LigerRMSNormFunction = LigerRopeFunction = LigerSiLUMulFunction = None
LIGER = ["liger_kernel"] if LigerRMSNormFunction else []
HIDDEN, HEAD_DIM, Q_HEADS, K_HEADS, FFN = 4096, 128, 32, 8, 8192


def hf_rope(q, k, cos, sin):
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)


LAYERS = {  # name: (inputs (shape, gets a gradient), ours, torch's, Liger's, passes)
    "rms-norm": (
        lambda n: [((n // HIDDEN, HIDDEN), True), ((HIDDEN,), True)],
        lambda x, w: rms_norm(x, (HIDDEN,), w),
        lambda x, w: F.rms_norm(x, (HIDDEN,), w),
        lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False),
        (2, 5),
    ),
    "rotary": (
        lambda n: [
            ((1, Q_HEADS, n // (Q_HEADS * HEAD_DIM), HEAD_DIM), True),
            ((1, K_HEADS, n // (Q_HEADS * HEAD_DIM), HEAD_DIM), True),
        ],
        lambda q, k, cos, sin: rotary_embedding_qk(q, k, cos, sin),
        hf_rope,
        lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos[None], sin[None]),
        (2 * 1.25, 4 * 1.25),  # k is a quarter of q
    ),
    "silu-mul": (
        lambda n: [((n // FFN, FFN), True), ((n // FFN, FFN), True)],
        silu_mul,
        lambda g, u: F.silu(g) * u,
        lambda g, u: LigerSiLUMulFunction.apply(g, u),
        (3, 8),
    ),
}


def make_call(layer, provider, n, dtype, backward):
    shapes, ours, theirs, liger, _ = LAYERS[layer]
    leaves = [
        torch.randn(shape, device=DEVICE, dtype=dtype).requires_grad_(
            backward and wants
        )
        for shape, wants in shapes(n)
    ]
    inputs = list(leaves)
    if layer == "rotary":
        inputs += rope_tables(leaves[0].shape[2], HEAD_DIM, dtype, DEVICE)
    if provider == "triton (two launches)":
        function = lambda q, k, c, s: (
            rotary_embedding(q, c, s),
            rotary_embedding(k, c, s),
        )
    else:
        function = {"triton": ours, "torch": theirs, "liger_kernel": liger}.get(
            provider
        )
    function = function or bench.compile_static(theirs)
    if not backward:
        return lambda: function(*inputs)
    outputs = as_tuple(function(*inputs))
    grads = [torch.randn_like(out) for out in outputs]
    return lambda: torch.autograd.grad(function(*inputs), leaves, grads)


def benchmark(layer, backward):
    passes = LAYERS[layer][4][backward]
    extra = ["triton (two launches)"] if layer == "rotary" else []
    providers = ["triton", *extra, "torch", "torch.compile", *LIGER]
    return bench.Benchmark(
        name=f"{layer}-forward{'-backward' if backward else ''}",
        x_name="elements",
        x_values=[2**i for i in range(24, 28)],
        providers=[*providers, bench.COPY_PROVIDER],
        make=lambda provider, n, dtype: make_call(layer, provider, n, dtype, backward),
        work=lambda n, dtype: passes * n * dtype.itemsize,
        dtypes=(torch.bfloat16, torch.float32),
        smoke_x=2**13,
        headline_x=2**24,
    )


summary = []
for layer in LAYERS:
    for backward in (False, True):
        results = bench.run(benchmark(layer, backward))
        if results is None:  # nothing measured or recorded
            continue
        for dtype in ("bfloat16", "float32"):
            ratios = [
                f"{results.ratio('triton', p, 2**27, dtype):.2f}x {p}"
                for p in results.providers()
                if p != "triton"
            ]
            summary.append(f"{results.bench.name}, {dtype}, 2^27: {', '.join(ratios)}")
print("\n".join(summary) or "No recordings of these benchmarks yet (see below).")

# %%
# These benchmarks are recorded on a GPU by ``make bench CHAPTERS=tutorials/14-modern-block.py``
# (``ONLY=rms-norm-forward,...`` for some of them); until then, without a GPU, the chapter shows
# none. Each line above is ours over a peer at 2^27 elements: above 1, we are ahead; the copy's
# ratio is our share of the limit. What the arithmetic predicts: against eager PyTorch, RoPE
# should gain the most (about 10 passes against 2) and the product less (5 against 3); for
# every layer the copy is the target. ``triton (two launches)`` rotates q, then k: it reads
# cos and sin twice, and pays a second launch.
#
# The modern block in chapter 12's GPT
# ------------------------------------
# Chapter 12's ``GPTConfig`` takes these layers as choices, GPT-2's block by default.
# ``norm="rms"`` puts RMSNorm where layer norm stood. ``position="rotary"`` drops the position
# embedding: the qkv projection's q and k are turned by ``rotary_embedding_qk`` in one launch,
# read through the strides of its output. ``mlp="swiglu"`` makes the MLP's first product write
# gate and up side by side, 8C/3 wide each (rounded up to a multiple of 64), so that its three
# matrices hold as many weights as GELU's two of 4C; ``silu_mul`` reads the two halves in
# place. ``n_kv_head`` gives k and v fewer heads than q, each shared by a group of query heads
# (grouped-query attention, Ainslie et al., 2023): the projection writes H + 2 H_kv heads
# instead of 3H. ``bias=False`` drops the biases, as Llama does.
#
# ``use_triton`` still switches every layer over one state dict; PyTorch's side is
# ``F.rms_norm``, ``rotate_half``, ``F.silu(gate) * up`` and SDPA with ``enable_gqa=True``.
# Chapter 11's attention takes the grouped k and v heads as they are, as SDPA does: each
# query head's programs read the k and v head of its group. One copy more than in
# GPT-2's block: the rotation writes q as (B, H, T, D), so the attention's output, written in
# q's layout, reaches the projection through a copy rather than as a view.
#
# ``python -m stepkernels.train --config modern-shakespeare`` trains chapter 12's Shakespeare
# model with this block: the same depth, width, context and recipe, and two heads of k and v
# for six of q.

import functools
import gc

from stepkernels.lessons import training
from stepkernels.models import train
from stepkernels.models.config import preset
from stepkernels.models.data import load_shakespeare
from stepkernels.models.gpt import GPT, flops_per_token

data = load_shakespeare()
BLOCKS = {"GPT-2 block": "shakespeare", "modern block": "modern-shakespeare"}
for block, name in BLOCKS.items():
    shape = preset(name).model_config(data.vocab_size)
    weights = sum(p.numel() for p in GPT(shape).parameters())
    print(
        f"{block:>12} (--config {name}): {weights / 1e6:.2f}M parameters, "
        f"{flops_per_token(shape) / 1e6:.1f} MFLOP a token of a training step"
    )

# %%
# The check of chapter 12, on the modern block: the same parameters, both sets of layers, in
# fp32, logits, loss and the gradient of every parameter. Here two blocks of width 32 with four
# heads of q and two of k and v; the preset's size under ``STEPKERNELS_FULL=1`` and in
# ``tests/test_gpt_modern.py`` on a GPU.

modern = preset("modern-shakespeare", dropout=0.0).model_config(data.vocab_size)
small = dataclasses.replace(
    modern, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16
)
check_shape = tutorial.choose(gpu=small, cpu=small, full=modern)
torch.manual_seed(0)
model = GPT(check_shape).to(DEVICE)
starts = torch.randint(len(data.train) - check_shape.block_size - 1, (4,)).tolist()
rows = torch.stack([data.train[i : i + check_shape.block_size + 1] for i in starts])
rows = rows.long().to(DEVICE)
print(training.compare_layers(model, rows[:, :-1], rows[:, 1:]))

# %%
# Does the modern block cost time? Per token it has 10% fewer FLOPs (the narrower qkv
# projection), but more launches than chapter 12's fused path: the residual addition and
# RMSNorm run apart (chapter 15 fused them for layer norm only), and so do the rotation and,
# for now, the copies of k and v. Each block trains its preset's model for 300 steps in bf16,
# the first 50 untimed, as chapter 12's race: PyTorch eager, PyTorch replayed from a CUDA
# graph, and ours replayed.

RACE = {  # provider: (use_triton, step)
    "torch": (False, "eager"),
    "torch + CUDA graph": (False, "graph"),
    "triton + CUDA graph": (True, "graph"),
}
TOKENS_PER_STEP = 64 * 256
QUIET = dict(
    eval_interval=0, eval_batches=1, checkpoint=False, sample_tokens=0, out_dir=""
)


@functools.cache
def block_race():
    """Tokens per second of each block's model, trained as each provider trains it."""
    points = []
    for block, name in BLOCKS.items():
        for provider, (use_triton, step) in RACE.items():
            cfg = preset(name, **QUIET, use_triton=use_triton, step=step, max_steps=300)
            run = train.Trainer(cfg, data).train(log=lambda line: None)
            rate = run["tokens_per_s"]
            points.append(
                bench.Point(f"{block}, {provider}", "bfloat16", TOKENS_PER_STEP, rate)
            )
            gc.collect(), torch.cuda.empty_cache()
    return points


providers = [f"{block}, {provider}" for block in BLOCKS for provider in RACE]
throughput = bench.run(
    bench.Benchmark(
        name="gpt-modern-training-throughput",
        x_name="tokens per step (64 sequences of 256)",
        x_values=[TOKENS_PER_STEP],
        providers=providers,
        make=None,
        work=None,
        unit="tokens/s",
        dtypes=(torch.bfloat16,),
        x_labels={TOKENS_PER_STEP: "chapter 12's Shakespeare model"},
    ),
    block_race,
)
if throughput:
    at = dict(x=TOKENS_PER_STEP, dtype="bfloat16")
    for provider in RACE:
        old, new = (throughput.value(f"{b}, {provider}", **at) for b in BLOCKS)
        print(
            f"{provider:>19}: {new:>9,.0f} tokens/s with the modern block, "
            f"{new / old:.2f}x GPT-2's block ({old:,.0f})"
        )

# %%
# What we learned
# ---------------
# * RMSNorm is layer norm without a mean: one sum of squares, and the same two-stage dW.
# * RoPE is linear, so its backward is its transposed rotation: the forward's kernel with two
#   signs changed. Strides, not copies, take q and k out of a fused projection.
# * Elementwise layers are worth exactly their bytes: count passes before writing a kernel,
#   and weigh a fusion against the time of what it would join (SwiGLU's epilogue).
# * A modern block is chapter 12's GPT with four choices in its configuration; checked the
#   same way, one set of parameters, two sets of layers, equal in fp32.
#
# Exercises
# ---------
# 1. Fuse the residual addition into ``rms_norm`` (``rms_norm(x + r)``, returning the sum
#    too), as Llama's blocks do twice a layer. How many passes does it save?
# 2. Take positions as an index tensor (``position_ids``) so that a batch of sequences that
#    start at different offsets (generation with a cache) reads the right rows of cos and sin.
# 3. Give chapter 05's linear an epilogue that stores silu(g) * u of interleaved gate and up
#    columns, for inference, and measure it against ``linear`` followed by ``silu_mul``.
# 4. Train ``--config modern-shakespeare`` and ``--config shakespeare`` on a GPU and compare
#    their validation curves against tokens seen, then against seconds: which block reaches a
#    loss of 1.5 first, and is it the same answer both ways?
