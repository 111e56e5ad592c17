"""ops.rms_norm: the code of chapter 14, RMSNorm, rotary embeddings and SwiGLU: the layers of a
modern decoder block."""

# Generated from tutorials/14-modern-block.py by tools/export.py: edit the chapter, then `make
# export`.

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
