"""ops.rotary: the code of chapter 14, RMSNorm, rotary embeddings and SwiGLU: the layers of a
modern decoder block."""

# Generated from tutorials/14-modern-block.py by tools/export.py: edit the chapter, then `make
# export`.

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
