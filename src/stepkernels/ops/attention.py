"""ops.attention: the code of chapter 11, Fused attention."""

# Generated from tutorials/11-fused-attention.py by tools/export.py: edit the chapter, then `make
# export`.

from dataclasses import dataclass
import functools
import math
from typing import NamedTuple

from stepkernels.ops.attention_launches import fit_to_device  # each GPU's shared memory
from stepkernels.runtime.arguments import is_number
from stepkernels.runtime.core import (
    FLOAT_DTYPES,
    INTERPRET,
    ON_GPU,
    check_tensor,
    refuse_double_backward,
)
from stepkernels.runtime.launch import cdiv, lean, next_power_of_2
from stepkernels.runtime.tiles import dot_precision
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2 e)
# The interpreter's tl.dot cannot take bf16 (docs/running.rst): fp32 tiles there.
UPCAST = tl.constexpr(INTERPRET)


class Tiling(NamedTuple):
    """A launch's compile-time choices, for the helpers that walk the other side's
    blocks (keys; queries in the dK, dV kernel)."""

    BLOCK: tl.constexpr  # rows of a walked block
    CAUSAL: tl.constexpr
    PRECISION: tl.constexpr  # of tl.dot: "ieee", or "tf32" for fp32


@triton.jit
def load_tile(heads, batch, head, row):
    """The tile of ``heads`` (a descriptor of a (B, H, N, D) tensor) at ``row`` of one
    head's N x D matrix: [BLOCK, HEAD_DIM], zeros past N and D."""
    tile = heads.load([batch, head, row, 0])
    tile = tl.reshape(tile, [tile.shape[2], tile.shape[3]])
    return tile.to(tl.float32) if UPCAST else tile


@triton.jit
def store_tile(heads, batch, head, row, tile):
    tile = tl.reshape(tile, [1, 1, tile.shape[0], tile.shape[1]]).to(heads.dtype)
    heads.store([batch, head, row, 0], tile)  # rows and columns past the end dropped


@triton.jit
def attend(
    state, block, key_side, lo, hi, scale_log2, MASK: tl.constexpr, TILING: tl.constexpr
):
    """The online softmax of a block of queries over the key blocks [lo, hi): ``state``
    (acc, row sum, row max) updated. ``block``: the Q tile and its rows; ``key_side``:
    the descriptors of K and V, the (batch, head) and the number of keys. MASK: drop
    keys past the end and, if causal, keys j > i, in the blocks that hold some."""
    acc, row_sum, row_max = state
    q, offs_m = block
    keys, values, batch, head, n_kv = key_side
    for start_n in tl.range(lo, hi, TILING.BLOCK):
        k = load_tile(keys, batch, head, start_n)
        scores = tl.dot(q, tl.trans(k), input_precision=TILING.PRECISION)
        if MASK:
            offs_n = start_n + tl.arange(0, TILING.BLOCK)
            keep = offs_n[None, :] < n_kv
            if TILING.CAUSAL:
                keep &= offs_n[None, :] <= offs_m[:, None]
            scores = tl.where(keep, scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * scale_log2)
        p = tl.exp2(scores * scale_log2 - new_max[:, None])  # one FMA a score
        alpha = tl.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = load_tile(values, batch, head, start_n)
        acc = tl.dot(
            p.to(v.dtype), v, acc * alpha[:, None], input_precision=TILING.PRECISION
        )
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit
def query_block(n_heads, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """This program's block of queries, and its (batch, head): axis 0 of the grid counts
    query blocks, axis 1 batch x heads. Causal programs take the longest rows first."""
    block = tl.program_id(0)
    if CAUSAL:
        block = tl.num_programs(0) - 1 - block
    start_m, bh = block * BLOCK_M, tl.program_id(1)
    return start_m, bh, bh // n_heads, bh % n_heads, start_m + tl.arange(0, BLOCK_M)


@lean  # cheap repeated launches, descriptors too: chapter 08
@triton.jit
def attention_forward_kernel(
    queries,  # descriptors of (B, H, N, D) tensors: Q, K, V and the output O
    keys,
    values,
    outputs,
    lse_ptr,  # (B x H, n_q) fp32: the log-sum-exp of each row, for the backward
    n_heads,
    n_q,
    n_kv,
    scale_log2,  # softmax scale x log2(e)
    BLOCK_M: tl.constexpr,  # queries a program
    BLOCK_N: tl.constexpr,  # keys a step
    HEAD_DIM: tl.constexpr,  # D padded to a power of two
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m, bh, batch, head, offs_m = query_block(n_heads, BLOCK_M, CAUSAL)
    q = load_tile(queries, batch, head, start_m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    state, block = (acc, row_sum, row_max), (q, offs_m)
    key_side = (keys, values, batch, head, n_kv)
    TILING: tl.constexpr = Tiling(BLOCK_N, CAUSAL, PRECISION)
    # Whole key blocks no row of ours masks, then the diagonal and the ragged end, masked.
    whole = n_kv // BLOCK_N * BLOCK_N
    end = tl.minimum(start_m // BLOCK_N * BLOCK_N, whole) if CAUSAL else whole
    hi = tl.minimum(start_m + BLOCK_M, n_kv) if CAUSAL else n_kv
    state = attend(state, block, key_side, 0, end, scale_log2, False, TILING)
    acc, row_sum, row_max = attend(
        state, block, key_side, end, hi, scale_log2, True, TILING
    )
    store_tile(outputs, batch, head, start_m, acc / row_sum[:, None])
    lse = row_max + tl.log2(row_sum)  # base 2, of scaled scores
    tl.store(lse_ptr + bh.to(tl.int64) * n_q + offs_m, lse, offs_m < n_q)


@triton.jit
def key_block_grads(
    state,
    block,
    query_side,
    lo,
    hi,
    scale_log2,
    MASK: tl.constexpr,
    TILING: tl.constexpr,
):
    """dK and dV of a block of keys over the query blocks [lo, hi), transposed: P is
    [keys, queries]. ``state``: (dK, dV); ``block``: the K and V tiles and their rows;
    ``query_side``: the descriptors of Q and dO, L and δ of the head, the (batch, head)
    and the number of queries. Rows past the end read as zeros (q, dO, L, δ) and add
    nothing. MASK: i < j."""
    dk, dv = state
    k, v, offs_n = block
    queries, grads, lse_row, delta_row, batch, head, n_q = query_side
    for start_m in tl.range(lo, hi, TILING.BLOCK):
        offs_m = start_m + tl.arange(0, TILING.BLOCK)
        q = load_tile(queries, batch, head, start_m)
        do = load_tile(grads, batch, head, start_m)
        lse = tl.load(lse_row + offs_m, offs_m < n_q, 0.0)
        delta = tl.load(delta_row + offs_m, offs_m < n_q, 0.0)
        scores = tl.dot(k, tl.trans(q), input_precision=TILING.PRECISION)
        p = tl.exp2(scores * scale_log2 - lse[None, :])
        if MASK:
            p = tl.where(offs_m[None, :] >= offs_n[:, None], p, 0.0)
        dv = tl.dot(p.to(do.dtype), do, dv, input_precision=TILING.PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=TILING.PRECISION)
        ds = p * (dp - delta[None, :])
        dk = tl.dot(ds.to(q.dtype), q, dk, input_precision=TILING.PRECISION)
    return dk, dv


@lean
@triton.jit
def attention_key_grads_kernel(
    queries,  # descriptors: Q, K, V, dO, and dK, dV written
    keys,
    values,
    grads,
    key_grads,
    value_grads,
    lse_ptr,  # (B x H, n_q) fp32: L from the forward, δ from the query programs
    delta_ptr,
    n_heads,
    n_q,
    scale_log2,  # softmax scale x log2(e)
    sm_scale,
    BLOCK_M: tl.constexpr,  # queries a step
    BLOCK_N: tl.constexpr,  # keys a program
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_n, bh = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    batch, head = bh // n_heads, bh % n_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k, v = (
        load_tile(keys, batch, head, start_n),
        load_tile(values, batch, head, start_n),
    )
    lse_row = lse_ptr + bh.to(tl.int64) * n_q
    delta_row = delta_ptr + bh.to(tl.int64) * n_q
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    state, block = (dk, dv), (k, v, offs_n)
    query_side = (queries, grads, lse_row, delta_row, batch, head, n_q)
    TILING: tl.constexpr = Tiling(BLOCK_M, CAUSAL, PRECISION)
    lo = 0
    if CAUSAL:  # queries i >= j only; those on the diagonal masked
        lo = start_n // BLOCK_M * BLOCK_M
        diagonal_end = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, n_q)
        state = key_block_grads(
            state, block, query_side, lo, diagonal_end, scale_log2, True, TILING
        )
        lo = tl.maximum(diagonal_end, lo)
    dk, dv = key_block_grads(
        state, block, query_side, lo, n_q, scale_log2, False, TILING
    )
    store_tile(key_grads, batch, head, start_n, dk * sm_scale)
    store_tile(value_grads, batch, head, start_n, dv)


@triton.jit
def query_block_grad(
    dq, block, key_side, lo, hi, scale_log2, MASK: tl.constexpr, TILING: tl.constexpr
):
    """dQ of a block of queries over the key blocks [lo, hi). ``block``: the Q and dO
    tiles, L, δ and the rows; ``key_side`` and MASK: as ``attend``'s. Keys past the end
    read as zeros, but exp2(0 - lse) overflows for a row whose scores are all far below
    zero, and inf x 0 is NaN: they are masked too."""
    q, do, lse, delta, offs_m = block
    keys, values, batch, head, n_kv = key_side
    for start_n in tl.range(lo, hi, TILING.BLOCK):
        k = load_tile(keys, batch, head, start_n)
        v = load_tile(values, batch, head, start_n)
        scores = tl.dot(q, tl.trans(k), input_precision=TILING.PRECISION)
        p = tl.exp2(scores * scale_log2 - lse[:, None])
        if MASK:
            offs_n = start_n + tl.arange(0, TILING.BLOCK)
            keep = offs_n[None, :] < n_kv
            if TILING.CAUSAL:
                keep &= offs_n[None, :] <= offs_m[:, None]
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=TILING.PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=TILING.PRECISION)
    return dq


@lean
@triton.jit
def attention_query_grad_kernel(
    queries,  # descriptors: Q, K, V, O, dO, and dQ written
    keys,
    values,
    outputs,
    grads,
    query_grads,
    lse_ptr,  # (B x H, n_q) fp32: L from the forward; δ written for the key programs
    delta_ptr,
    n_heads,
    n_q,
    n_kv,
    scale_log2,  # softmax scale x log2(e)
    sm_scale,
    BLOCK_M: tl.constexpr,  # queries a program
    BLOCK_N: tl.constexpr,  # keys a step
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m, bh, batch, head, offs_m = query_block(n_heads, BLOCK_M, CAUSAL)
    q, do = (
        load_tile(queries, batch, head, start_m),
        load_tile(grads, batch, head, start_m),
    )
    o = load_tile(outputs, batch, head, start_m).to(tl.float32)
    delta = tl.sum(o * do.to(tl.float32), axis=1)  # for the key programs, too
    tl.store(delta_ptr + bh.to(tl.int64) * n_q + offs_m, delta, offs_m < n_q)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * n_q + offs_m, offs_m < n_q, 0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    whole = n_kv // BLOCK_N * BLOCK_N  # the forward's blocks: whole, then masked
    end = tl.minimum(start_m // BLOCK_N * BLOCK_N, whole) if CAUSAL else whole
    hi = tl.minimum(start_m + BLOCK_M, n_kv) if CAUSAL else n_kv
    block, key_side = (q, do, lse, delta, offs_m), (keys, values, batch, head, n_kv)
    TILING: tl.constexpr = Tiling(BLOCK_N, CAUSAL, PRECISION)
    dq = query_block_grad(dq, block, key_side, 0, end, scale_log2, False, TILING)
    dq = query_block_grad(dq, block, key_side, end, hi, scale_log2, True, TILING)
    store_tile(query_grads, batch, head, start_m, dq * sm_scale)


MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class Launch:
    block_m: int  # queries per block
    block_n: int  # keys per block
    num_warps: int
    num_stages: int


@functools.cache
@fit_to_device  # these are the H100's: fewer stages or smaller blocks where they do not fit
def default_launches(head_dim: int, element_size: int, causal: bool):
    """(forward, key gradients, query gradient) for a head dim padded to a power of
    two."""
    if not ON_GPU:
        return (Launch(16, 16, 4, 1),) * 3
    if element_size == 4:  # fp32 tiles are twice as large: fewer stages fit
        return Launch(64, 32, 4, 2), Launch(32, 64, 4, 2), Launch(64, 32, 4, 2)
    if head_dim <= 64:
        query = Launch(64, 64, 4, 3) if causal else Launch(128, 64, 8, 3)
        return Launch(64, 64, 4, 3), Launch(64, 64, 4, 3), query
    return Launch(64, 64, 4, 3), Launch(32, 64, 4, 3), Launch(128, 64, 8, 3)


def descriptor_ready(t: torch.Tensor) -> bool:
    """Can a TMA descriptor describe each (N, D) matrix of this (B, H, N, D) tensor?"""
    size = t.element_size()
    aligned = all(s * size % 16 == 0 for s in t.stride()[:3])
    return t.stride(3) == 1 and aligned and t.data_ptr() % 16 == 0


def empty_heads(shape, dtype, device, like=None) -> torch.Tensor:
    """A new (B, H, N, D) tensor whose rows start on 16-byte boundaries, its heads
    interleaved ((B, N, H, D) in memory) when those of ``like`` are."""
    step = 16 // dtype.itemsize
    padded = -(-shape[3] // step) * step
    if like is not None and like.stride(1) < like.stride(2):
        rows = torch.empty(
            shape[0], shape[2], shape[1], padded, dtype=dtype, device=device
        )
        return rows.transpose(1, 2)[..., : shape[3]]
    return torch.empty(*shape[:3], padded, dtype=dtype, device=device)[..., : shape[3]]


def ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it that a descriptor can describe."""
    ok = descriptor_ready(t)
    return t if ok else empty_heads(t.shape, t.dtype, t.device).copy_(t)


def padded_head_dim(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def heads(t: torch.Tensor, block: int) -> TensorDescriptor:
    """A TMA descriptor of a (B, H, N, D) tensor, read and written in [block, D] tiles
    of one head (D padded to a power of two: zeros past the end)."""
    tile = [1, 1, block, padded_head_dim(t.shape[3])]
    # Triton's constructor checks what ``descriptor_ready`` has checked of every tensor
    # that gets here, at 3 µs a descriptor and 16 descriptors a forward and backward:
    # the fields are set without checking again.
    described = object.__new__(TensorDescriptor)
    described.__dict__.update(
        base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=tile
    )
    return described


def attention_forward(q, k, v, causal, sm_scale, launch=None):
    """O and the base-2 log-sum-exp of each row, for descriptor-ready q, k, v."""
    batch, n_heads, n_q, head_dim = q.shape
    o = empty_heads(q.shape, q.dtype, q.device, like=q)
    lse = torch.empty(batch * n_heads, n_q, device=q.device, dtype=torch.float32)
    padded = padded_head_dim(head_dim)
    launch = launch or default_launches(padded, q.element_size(), causal)[0]
    m, n = launch.block_m, launch.block_n
    attention_forward_kernel[(cdiv(n_q, m), batch * n_heads)](
        heads(q, m),
        heads(k, n),
        heads(v, n),
        heads(o, m),
        lse,
        n_heads,
        n_q,
        k.shape[2],
        sm_scale * LOG2E,
        BLOCK_M=m,
        BLOCK_N=n,
        HEAD_DIM=padded,
        CAUSAL=causal,
        PRECISION=dot_precision(q.dtype),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return o, lse


def attention_backward(
    q, k, v, o, lse, do, causal, sm_scale, launches=None, grads=None
):
    """dQ, dK, dV for descriptor-ready tensors; ``launches``: (key, query) gradients;
    ``grads``: descriptor-ready dQ, dK, dV to write into (a caller's layout), else new."""
    batch, n_heads, n_q, head_dim = q.shape
    padded = padded_head_dim(head_dim)
    _, key_launch, query_launch = default_launches(padded, q.element_size(), causal)
    key_launch, query_launch = launches or (key_launch, query_launch)
    new = (empty_heads(t.shape, t.dtype, t.device) for t in (q, k, v))
    dq, dk, dv = new if grads is None else grads
    delta = torch.empty_like(lse)
    options = dict(HEAD_DIM=padded, CAUSAL=causal, PRECISION=dot_precision(q.dtype))
    m, n = query_launch.block_m, query_launch.block_n  # first: it writes δ
    attention_query_grad_kernel[(cdiv(n_q, m), batch * n_heads)](
        heads(q, m),
        heads(k, n),
        heads(v, n),
        heads(o, m),
        heads(do, m),
        heads(dq, m),
        lse,
        delta,
        n_heads,
        n_q,
        k.shape[2],
        sm_scale * LOG2E,
        sm_scale,
        BLOCK_M=m,
        BLOCK_N=n,
        **options,
        num_warps=query_launch.num_warps,
        num_stages=query_launch.num_stages,
    )
    m, n = key_launch.block_m, key_launch.block_n
    attention_key_grads_kernel[(cdiv(k.shape[2], n), batch * n_heads)](
        heads(q, m),
        heads(k, n),
        heads(v, n),
        heads(do, m),
        heads(dk, n),
        heads(dv, n),
        lse,
        delta,
        n_heads,
        n_q,
        sm_scale * LOG2E,
        sm_scale,
        BLOCK_M=m,
        BLOCK_N=n,
        **options,
        num_warps=key_launch.num_warps,
        num_stages=key_launch.num_stages,
    )
    return dq, dk, dv


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        q, k, v = ready(q), ready(k), ready(v)
        o, lse = attention_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        refuse_double_backward("attention", "F.scaled_dot_product_attention")
        q, k, v, o, lse = ctx.saved_tensors
        grads = attention_backward(q, k, v, o, lse, ready(do), ctx.causal, ctx.sm_scale)
        return *grads, None, None


def check_attention_inputs(q, k, v, causal, sm_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, FLOAT_DTYPES)
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be (batch, heads, sequence, head_dim), got "
                f"{tuple(t.shape)}; from (B, N, H, D): .transpose(1, 2)"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        raise ValueError(
            f"k and v must have one shape, q the same batch, heads and head "
            f"dim (no grouped heads, no other value head dim): {shapes}"
        )
    if not 0 < q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be 1 to {MAX_HEAD_DIM}, got {q.shape[3]}")
    if k.shape[2] == 0 and q.shape[2] > 0:
        raise ValueError("there are queries but no keys: pass at least one key")
    if sm_scale is not None and not is_number(sm_scale):
        raise TypeError(f"sm_scale must be a number or None, got {sm_scale!r}")
    if sm_scale is not None and not (1e-45 <= sm_scale < math.inf):
        raise ValueError(  # smaller scales vanish in fp32: masked -inf scores x 0 = NaN
            f"sm_scale must be a finite number >= 1e-45 or None, got {sm_scale!r}"
        )
    if not isinstance(causal, bool):  # "no" would mean True
        raise TypeError(f"causal must be True or False, got {causal!r}")


def attention(q, k, v, causal=False, sm_scale=None):
    """``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
    scale=sm_scale)`` for (batch, heads, sequence, head_dim) tensors in fp16, bf16 or
    fp32 (tf32 products unless ``torch.set_float32_matmul_precision("highest")``), with
    autograd. ``causal``: query i sees keys j <= i, as SDPA's ``is_causal``. Head dims
    up to 128."""
    check_attention_inputs(q, k, v, causal, sm_scale)
    scale = q.shape[3] ** -0.5 if sm_scale is None else float(sm_scale)
    if q.numel() == 0:  # nothing to attend: SDPA's result, an empty or zero tensor
        return q.new_zeros(q.shape) + 0 * (q.sum() + k.sum() + v.sum())
    if torch.compiler.is_compiling():  # an operator the compiler calls (below)
        return attention_op(q, k, v, causal, scale)[0]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return AttentionFunction.apply(q, k, v, causal, scale)
    return attention_forward(ready(q), ready(k), ready(v), causal, scale)[0]


from torch import Tensor
from torch.library import custom_op


@custom_op("stepkernels::attention", mutates_args=())
def attention_op(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float
) -> tuple[Tensor, Tensor]:
    return attention_forward(ready(q), ready(k), ready(v), causal, sm_scale)  # o, lse


@attention_op.register_fake
def _(q, k, v, causal, sm_scale):
    lse = q.new_empty((q.shape[0] * q.shape[1], q.shape[2]), dtype=torch.float32)
    return empty_heads(q.shape, q.dtype, q.device, like=q), lse


@custom_op("stepkernels::attention_backward", mutates_args=())
def attention_backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    causal: bool,
    sm_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, o, do = (ready(t) for t in (q, k, v, o, do))
    return attention_backward(q, k, v, o, lse, do, causal, sm_scale)


@attention_backward_op.register_fake
def _(q, k, v, o, lse, do, causal, sm_scale):
    return tuple(empty_heads(t.shape, t.dtype, t.device) for t in (q, k, v))


def attention_setup(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.sm_scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.set_materialize_grads(False)  # lse gets no gradient


def attention_op_backward(ctx, do, _lse_grad):
    refuse_double_backward("attention", "F.scaled_dot_product_attention")
    grads = attention_backward_op(*ctx.saved_tensors, do, ctx.causal, ctx.sm_scale)
    return *grads, None, None


attention_op.register_autograd(attention_op_backward, setup_context=attention_setup)
