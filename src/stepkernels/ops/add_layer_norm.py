"""ops.add_layer_norm: the code of chapter 15, The training step outside the products."""

# Generated from tutorials/15-training-step.py by tools/export.py: edit the chapter, then `make
# export`.

import functools
import math

from stepkernels.ops.layer_norm import layer_norm  # rows too long for one program
from stepkernels.runtime.arguments import layer_norm_arguments
from stepkernels.runtime.core import (
    INTERPRET,
    check_tensor,
    refuse_double_backward,
    sm_count,
)
from stepkernels.runtime.launch import lean
from stepkernels.runtime.partials import (  # chapter 03: dW and dB in two stages
    flush_partials,
)
from stepkernels.runtime.partials import (
    sum_partials as second_stage,
)
from stepkernels.runtime.rows import as_rows
import torch
import triton
import triton.language as tl


@lean
@triton.jit
def add_layer_norm_forward_kernel(
    x_ptr,  # the residual stream, (M, N)
    residual_ptr,  # what a layer adds to it, (M, N), maybe another dtype
    h_ptr,  # out: h = x + residual, in the wider of the two dtypes
    y_ptr,  # out: layer_norm(h), in h's dtype or the next product's (out_dtype)
    weight_ptr,
    bias_ptr,
    mean_ptr,  # out: each row's mean and 1 / std, fp32, for the backward
    rstd_ptr,
    x_row_stride,  # the inputs' rows may be strided (a slice); the outputs' are N apart
    residual_row_stride,
    M,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(axis=0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]  # row * stride can pass 2**31
    offsets = rows64 * N + cols[None, :]
    x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
    residual_ptrs = residual_ptr + rows64 * residual_row_stride + cols[None, :]
    residual = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
    x = x.to(tl.float32)
    h = (x + residual).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offsets, h, mask=mask)
    h = h.to(tl.float32)  # the rounded sum, as the backward will read it
    mean = tl.sum(h, axis=1) / N
    centered = tl.where(mask, h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@lean
@triton.jit
def add_layer_norm_backward_kernel(
    h_ptr,  # the saved sum
    dy_ptr,  # gradient of y
    dh_ptr,  # gradient of h from its other uses (the stream goes on); HAS_DH
    dx_ptr,  # out: gradient of x and of residual, dh + layer_norm's backward of dy
    dx_low_ptr,  # out: the same in the other input's dtype (bf16 update); HAS_DX_LOW
    weight_ptr,
    mean_ptr,
    rstd_ptr,
    partial_ptr,  # out: each program's sums of dy * h_hat and dy, (programs, 2, N)
    dy_row_stride,
    dh_row_stride,
    M,
    N,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_DX_LOW: tl.constexpr,
    REDUCTION: tl.constexpr,  # "two-stage": a partial row a program (chapter 03)
):
    program_id = tl.program_id(axis=0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw, db = tl.zeros([BLOCK_N], tl.float32), tl.zeros([BLOCK_N], tl.float32)
    for i in tl.range(ROWS_PER_PROGRAM):
        row = program_id * ROWS_PER_PROGRAM + i
        mask = cols < tl.where(row < M, N, 0)
        row64 = row.to(tl.int64)
        h = tl.load(h_ptr + row64 * N + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row64 * dy_row_stride + cols, mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        safe_row = tl.minimum(row, M - 1)  # rows past M read row M - 1, add nothing
        mean, rstd = tl.load(mean_ptr + safe_row), tl.load(rstd_ptr + safe_row)
        h_hat, wdy = (h - mean) * rstd, w * dy if HAS_WEIGHT else dy
        c1, c2 = tl.sum(h_hat * wdy, axis=0) / N, tl.sum(wdy, axis=0) / N
        dx = (wdy - (h_hat * c1 + c2)) * rstd
        if HAS_DH:
            dh = tl.load(dh_ptr + row64 * dh_row_stride + cols, mask=mask, other=0.0)
            dx += dh.to(tl.float32)
        tl.store(dx_ptr + row64 * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DX_LOW:  # rounded here, not by a cast kernel that reads dx again
            low = dx.to(dx_low_ptr.dtype.element_ty)
            tl.store(dx_low_ptr + row64 * N + cols, low, mask=mask)
        dw, db = dw + dy * h_hat, db + dy  # masked lanes: dy = 0
    slots = (program_id, program_id, 0)
    flush_partials(
        (partial_ptr, partial_ptr), (dw, db), (cols, col_mask), N, slots, REDUCTION
    )


MAX_BLOCK = 8192  # longer rows: the sum, then chapter 03's layer norm
FORWARD_TILE = 4096  # values a forward program holds: rows of up to 4,096 columns
BACKWARD_MAX_ROWS = 64


@functools.cache  # once per shape: off the call's path
def forward_config(n_cols, n_rows):
    block = triton.next_power_of_2(n_cols)
    rows = max(1, min(FORWARD_TILE // block, triton.next_power_of_2(n_rows)))
    warps = max(1, min(16, rows * block // 1024))
    return dict(BLOCK_N=block, ROWS_PER_PROGRAM=rows, num_warps=warps)


@functools.cache
def backward_config(n_cols, n_rows):
    """A row at a time, as chapter 03's backward: enough programs to fill the GPU, each
    with enough rows that the partial sums stay small beside the stream."""
    block = triton.next_power_of_2(n_cols)
    programs = 4 if INTERPRET else max(1, 4096 // block) * sm_count()
    wanted = triton.next_power_of_2(triton.cdiv(n_rows, programs))
    rows = min(BACKWARD_MAX_ROWS, wanted)
    return dict(BLOCK_N=block, ROWS_PER_PROGRAM=rows, num_warps=max(4, block // 1024))


def add_layer_norm_forward(x, residual, weight, bias, eps, out_dtype):
    """h, y, and each row's mean and 1 / std (fp32) for (M, N) rows x and residual."""
    (n_rows, n_cols), device = x.shape, x.device
    dtype = torch.promote_types(x.dtype, residual.dtype)
    h = torch.empty((n_rows, n_cols), device=device, dtype=dtype)
    y = torch.empty_like(h, dtype=out_dtype or dtype)
    mean, rstd = (torch.empty(n_rows, device=device) for _ in "mr")
    forward = forward_config(n_cols, n_rows)
    grid = (triton.cdiv(n_rows, forward["ROWS_PER_PROGRAM"]),)
    affine = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    add_layer_norm_forward_kernel[grid](
        x,
        residual,
        h,
        y,
        weight if weight is not None else h,
        bias if bias is not None else h,
        mean,
        rstd,
        x.stride(0),
        residual.stride(0),
        n_rows,
        n_cols,
        eps,
        **affine,
        **forward,
    )
    return h, y, mean, rstd


def add_layer_norm_backward(h, dy, dh, weight, mean, rstd, low_dtype=None):
    """dx in h's dtype (the gradient of x and of the update), the same in ``low_dtype``
    (an empty tensor if None), and the (2, N) fp32 sums of dW and dB; dy and dh (None:
    h not used further) as rows."""
    (n_rows, n_cols), device = h.shape, h.device
    backward = backward_config(n_cols, n_rows)
    programs = triton.cdiv(n_rows, backward["ROWS_PER_PROGRAM"])
    partials = torch.empty((programs, 2, n_cols), device=device)
    dx = torch.empty_like(h)
    dx_low = (
        h.new_empty(0) if low_dtype is None else torch.empty_like(h, dtype=low_dtype)
    )
    add_layer_norm_backward_kernel[(programs,)](
        h,
        dy,
        dh if dh is not None else dy,
        dx,
        dx if low_dtype is None else dx_low,
        weight if weight is not None else h,
        mean,
        rstd,
        partials,
        dy.stride(0),
        dy.stride(0) if dh is None else dh.stride(0),
        n_rows,
        n_cols,
        HAS_WEIGHT=weight is not None,
        HAS_DH=dh is not None,
        HAS_DX_LOW=low_dtype is not None,
        REDUCTION="two-stage",
        **backward,
    )
    return dx, dx_low, sum_partials(partials)  # (2, N): fp32, rounded once by callers


def sum_partials(partials):
    """The (2, N) sums of (programs, 2, N) partial sums by chapter 03's second stage:
    narrow column blocks, each program's share of the partials loaded in tiles."""
    n_cols = partials.shape[2]
    sums = partials.new_empty((2, n_cols))
    visits = partials  # no visit counts (HAS_COUNTS False): not read
    flags = dict(HAS_COUNTS=False, HAS_DW=True, HAS_DB=True)
    second_stage(partials, visits, *sums, n_cols, **flags)
    return sums


def low_dtype_of(h, dtypes):
    """The inputs' dtype other than h's (the update's, under autocast), else None."""
    return next((dtype for dtype in dtypes if dtype != h.dtype), None)


def input_grads(dx, dx_low, dtypes):
    """dx as the gradient of each input, in that input's dtype."""
    return tuple(
        dx if d == dx.dtype else dx_low if d == dx_low.dtype else dx.to(d)
        for d in dtypes
    )


def weight_grads(sums, h, weight, has_bias):
    """dW and dB from their fp32 sums, each rounded once; None where there is none."""
    grad_dtype = h.dtype if weight is None else weight.dtype
    dw = sums[0].to(grad_dtype) if weight is not None else None
    db = sums[1].to(grad_dtype) if has_bias else None
    return dw, db


class AddLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, out_dtype):
        h, y, mean, rstd = add_layer_norm_forward(
            x, residual, weight, bias, eps, out_dtype
        )
        if ctx is not None:
            # an unused output's gradient: None, not zeros
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(h, weight, mean, rstd)
            ctx.dtypes, ctx.has_bias = (x.dtype, residual.dtype), bias is not None
        return h, y

    @staticmethod
    def backward(ctx, dh, dy):
        return add_layer_norm_grads(ctx, dh, dy, add_layer_norm_backward)


def add_layer_norm_grads(ctx, dh, dy, backward):
    """The gradients of (x, residual, weight, bias, eps, out_dtype) from those of (h, y),
    with ``backward`` the kernels' launch (eager, or the operator the compiler sees)."""
    refuse_double_backward("add_layer_norm", "torch.nn.functional.layer_norm")
    h, weight, mean, rstd = ctx.saved_tensors
    dx_dtype, residual_dtype = ctx.dtypes
    if dy is None:  # y unused: the sum's gradient passes through, none for w and b
        return dh.to(dx_dtype), dh.to(residual_dtype), None, None, None, None
    dy, dh = as_rows(dy), None if dh is None else as_rows(dh)
    low = low_dtype_of(h, ctx.dtypes)
    dx, dx_low, sums = backward(h, dy, dh, weight, mean, rstd, low)
    dw, db = weight_grads(sums, h, weight, ctx.has_bias)
    return *input_grads(dx, dx_low, ctx.dtypes), dw, db, None, None


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def add_layer_norm(
    x, residual, normalized_shape, weight=None, bias=None, eps=1e-5, *, out_dtype=None
):
    """(h, y): h = x + residual, y = ``layer_norm(h, normalized_shape, weight, bias, eps)``,
    in one pass over memory. h's dtype is the wider of x's and residual's (fp32 for an fp32
    stream plus a bf16 update under autocast); y's is ``out_dtype``, else h's: computed in
    fp32 and rounded once, as a cast of PyTorch's fp32 norm to the next product's dtype."""
    shape = layer_norm_arguments(
        x,
        normalized_shape,
        weight,
        bias,
        eps,
        "two-stage",
        None,
        SUPPORTED_DTYPES,
        ("two-stage",),
    )
    check_tensor(residual, "residual", SUPPORTED_DTYPES)
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"out_dtype must be one of {SUPPORTED_DTYPES}, got {out_dtype!r}"
        )
    if residual.shape != x.shape or residual.device != x.device:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)} and device {x.device}, got "
            f"{tuple(residual.shape)} on {residual.device}: broadcast it with expand_as(x)"
        )
    n_cols = math.prod(shape)
    if n_cols > MAX_BLOCK or x.numel() == 0:  # the sum, then chapter 03's kernels
        h = x + residual
        return h, layer_norm(h, shape, weight, bias, eps).to(out_dtype or h.dtype)
    x2d, residual2d = (as_rows(t.reshape(-1, n_cols)) for t in (x, residual))
    flat = lambda p: None if p is None else p.reshape(-1).contiguous()
    args = (x2d, residual2d, flat(weight), flat(bias), float(eps), out_dtype)
    if torch.compiler.is_compiling():  # an operator the compiler traces (below)
        h, y, _, _ = add_layer_norm_forward_op(*args)
        return h.view(x.shape), y.view(x.shape)
    grads = any(t is not None and t.requires_grad for t in (x, residual, weight, bias))
    if grads and torch.is_grad_enabled():
        h, y = AddLayerNormFunction.apply(*args)
    else:
        h, y = AddLayerNormFunction.forward(None, *args)
    return h.view(x.shape), y.view(x.shape)


from stepkernels.runtime.launch import concrete  # a kernel per shape, as in eager calls
from torch import Tensor
from torch.library import triton_op


@triton_op("stepkernels::add_layer_norm_forward", mutates_args={})
def add_layer_norm_forward_op(
    x2d: Tensor,
    residual2d: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows = (concrete(x2d), concrete(residual2d))
    return add_layer_norm_forward(
        *rows, weight, bias, eps, out_dtype
    )  # h, y, mean, rstd


@triton_op("stepkernels::add_layer_norm_backward", mutates_args={})
def add_layer_norm_backward_op(
    h: Tensor,
    dy: Tensor,
    dh: Tensor | None,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    low_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    rows = (concrete(h), concrete(dy), None if dh is None else concrete(dh))
    # dx, dx in low_dtype (or empty), the sums of dW and dB
    return add_layer_norm_backward(*rows, weight, mean, rstd, low_dtype)


def add_layer_norm_setup(ctx, inputs, output):
    x2d, residual2d, weight, bias, _, _ = inputs
    h, _, mean, rstd = output
    ctx.save_for_backward(h, weight, mean, rstd)
    ctx.dtypes, ctx.has_bias = (x2d.dtype, residual2d.dtype), bias is not None
    ctx.set_materialize_grads(False)  # as in the Function: None for an unused output


def add_layer_norm_op_backward(ctx, dh, dy, _mean_grad, _rstd_grad):
    return add_layer_norm_grads(ctx, dh, dy, add_layer_norm_backward_op)


add_layer_norm_forward_op.register_autograd(
    add_layer_norm_op_backward, setup_context=add_layer_norm_setup
)
