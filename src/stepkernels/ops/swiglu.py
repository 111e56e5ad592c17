"""ops.swiglu: the code of chapter 14, RMSNorm, rotary embeddings and SwiGLU: the layers of a
modern decoder block."""

# Generated from tutorials/14-modern-block.py by tools/export.py: edit the chapter, then `make
# export`.

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
