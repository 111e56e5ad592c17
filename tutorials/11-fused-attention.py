r"""
Fused attention
===============

We write attention, softmax(Q Kᵀ · scale) V, as kernels that never hold the N x N scores: a
forward that streams keys and values past a block of queries, and a backward that rebuilds
what it needs from the forward's log-sum-exp. What you will learn:

* why naive attention is bound by memory and fused attention by the tensor cores;
* chapter 02's online softmax in a tiled kernel, the scale folded into exp2;
* which blocks a causal mask touches; tiles through TMA descriptors, zeros past the edges;
* FlashAttention-2's split of the backward, without atomics: the same bits on every run.

Prerequisites: chapter 02 (the online softmax), chapter 05 (autograd), chapter 07 (TMA).
"""

# %%
# Setup
# -----

import itertools

from stepkernels.lessons import bench, check_attention, tutorial
import torch
from torch.nn.attention import SDPBackend

tutorial.announce()
DEVICE = tutorial.DEVICE

# %%
# What attention costs
# --------------------
# For each of B x H heads, queries Q (N x D), keys K and values V (N x D):
#
#     S = Q Kᵀ · scale,   P = softmax(S) (row by row),   O = P V.
#
# Two matrix products of 2 N² D FLOPs each: **4 B H N² D** in the forward, half of that with a
# causal mask (query i sees keys j <= i). The backward has five products (dV = Pᵀ dO,
# dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q, and S again): 2.5 times the forward.
#
# Naive attention writes S and P to memory, N² values per head, and reads each back: bound
# by the bytes of the scores, not by its FLOPs. Fused, the compulsory bytes are those of the
# four N x D matrices, 8 N D in bf16, for 4 N² D FLOPs: N / 2 FLOPs per byte, past the
# H100's balance point (about 990 TFLOP/s over 3.35 TB/s, published: 295) from N of 600.

for n in (1024, 4096, 16384):
    scores, qkvo = 2 * n * n * 2, 4 * n * 128 * 2  # bytes in bf16, D = 128
    print(
        f"N = {n:>6,}: S, P {scores >> 20:5,} MiB a head; Q, K, V, O {qkvo >> 20} MiB"
    )

# %%
# The forward: online softmax over key blocks
# -------------------------------------------
# A program owns BLOCK_M queries and walks the keys in blocks of BLOCK_N. For each block it
# computes the scores, then updates chapter 02's running maximum m and sum ℓ of each row and
# the output accumulator, rescaling what it holds when the maximum grows:
#
#     m' = max(m, rowmax(S_blk)),   α = exp(m - m'),   P_blk = exp(S_blk - m'),
#     ℓ' = α ℓ + rowsum(P_blk),    acc' = α acc + P_blk V_blk.
#
# At the end O = acc / ℓ; we keep L = m + log ℓ per row, all the backward needs to rebuild P.
#
# * **exp2 with the scale folded in**: exp(x · scale) = 2^(x · scale · log2 e): one fused
#   multiply-add per score makes the exponent; m, ℓ and L live in that base-2 unit.
# * **Masks only where needed**: with ``causal``, key blocks left of the diagonal need no
#   mask and those right of it are skipped; only the diagonal and the ragged last block pay
#   for ``tl.where``. The loop runs twice, unmasked then masked (``MASK`` is a constexpr:
#   two compiled loops). Causal programs start with the longest rows.
# * **Tiles through tensor descriptors**: a ``TensorDescriptor`` describes the whole
#   (B, H, N, D) tensor to the TMA unit (chapter 07), which copies [1, 1, BLOCK, D] tiles to
#   shared memory while the warps compute, reads past the edges as zeros and drops them on a
#   store: ragged lengths and head dims such as 80 need no masks. It wants the last dimension
#   contiguous and the other strides multiples of 16 bytes. We make it once, on the host:
#   made in the kernel (``tl.make_tensor_descriptor``, as chapter 07 does), every program
#   would build its own, which cost up to 30% of the forward's time at N = 512 on the H100.
#
# The helpers that walk blocks (``attend`` here, two more in the backward) take their
# arguments in groups, each a tuple: what they update (``state``), the block the program
# owns, the other side's descriptors with its (batch, head) and length, and the launch's
# compile-time choices as one ``Tiling``. Triton inlines them: the compiled kernel is the
# one a helper of sixteen loose arguments gave, instruction for instruction.

# @save ops/attention
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


# %%
# The backward, split by what each program owns
# ---------------------------------------------
# With P rebuilt from L (P = exp2(S · scale · log2 e - L)), the gradients are
#
#     dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP - δ),   δ_i = Σ_d dO_id O_id,
#     dQ = scale · dS K,   dK = scale · dSᵀ Q,
#
# δ is the softmax backward's row term. dK and dV sum over queries, dQ over keys: no one
# tiling owns all three. A program per *key* block keeps K, V
# and the dK, dV accumulators on chip while it walks the query blocks; a program per *query*
# block does the same for dQ. Both rebuild P: seven products where five would do. Adding dQ
# from the key programs with atomics saves two, but the result then depends on the order the
# atomics land in; we keep the bits repeatable. The query programs run first and store δ
# for the key programs. Causal loops split as in the forward.


# @save ops/attention
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


# %%
# Launches, layouts and the autograd function
# -------------------------------------------
# Launch rules (blocks of queries x keys, warps, stages) are the fastest of a sweep on the
# H100 over blocks of 32 to 128, 4 or 8 warps and 1 to 4 stages. A tensor no descriptor
# can describe (last dimension not contiguous; D = 20 in fp16, rows of 40 bytes) is copied
# once, contiguous with rows padded to 16 bytes; a (B, N, H, D) tensor viewed as (B, H, N, D)
# is read in place, and O is then written in q's layout, as SDPA does: ``o.transpose(1, 2)``
# is the (B, N, H·D) input of the next projection without a copy. Under the interpreter the
# blocks are 16 x 16.

# @save ops/attention
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


def attention_backward(q, k, v, o, lse, do, causal, sm_scale, launches=None):
    """dQ, dK, dV for descriptor-ready tensors; ``launches``: (key, query) gradients."""
    batch, n_heads, n_q, head_dim = q.shape
    padded = padded_head_dim(head_dim)
    _, key_launch, query_launch = default_launches(padded, q.element_size(), causal)
    key_launch, query_launch = launches or (key_launch, query_launch)
    dq, dk, dv = (empty_heads(t.shape, t.dtype, t.device) for t in (q, k, v))
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


# %%
# ``torch.compile`` sees attention as an operator of ``torch.library`` (chapter 08). Its
# kernels take TMA descriptors built on the host, which the compiler cannot trace into a graph,
# so this one is a ``custom_op``: opaque, called by the compiled graph as it is, with a fake
# implementation that gives the outputs' shapes and strides, and its derivative.

# @save ops/attention
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


# %%
# Correctness
# -----------
# ``check_attention.check`` compares the output and the three gradients with SDPA computed in
# fp64, within a rounding of the dtype: lengths that are not multiples of a block (queries and
# keys apart), a head dim of 80 (padded to 128 in the kernels), causal and not, and the layout
# a fused projection gives, (B, N, H, D) viewed as (B, H, N, D); tests/ has the rest. Then the
# errors that say what to do. Each dtype, causal or not, compiles three kernels, seconds each
# on a GPU: a quick GPU run checks two of the three sizes, both ragged, in bf16 causal and
# not, fp16 causal and fp32 not (the benchmarks below reuse the bf16 kernels);
# ``STEPKERNELS_FULL=1`` checks all, as the interpreter does, and ``tests/test_attention.py``
# every dtype, causal and not, at 1,000 × 1,000 on a GPU.

SIZES = [(130, 130), (1000, 1000), (77, 300)]  # (queries, keys) on a GPU
sizes = tutorial.choose(gpu=[SIZES[0], SIZES[2]], cpu=[(33, 50)], full=SIZES)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
EVERY_CASE = list(itertools.product(DTYPES, (False, True)))  # (dtype, causal)
QUICK_CASES = EVERY_CASE[:3] + [(torch.float32, False)]
CHECK_CASES = tutorial.choose(gpu=QUICK_CASES, cpu=EVERY_CASE, full=EVERY_CASE)
for (dtype, causal), (n_q, n_kv) in itertools.product(CHECK_CASES, sizes):
    q, k, v = check_attention.inputs(2, 3, n_q, n_kv, 80, dtype, DEVICE)
    check_attention.check(attention, q, k, v, causal=causal)
q, k, v = check_attention.inputs(2, 3, 40, 40, 128, torch.bfloat16, DEVICE, "BNHD")
check_attention.check(attention, q, k, v, causal=True)
print(f"attention matches SDPA: {len(sizes)} sizes, head dims 80 and 128, 3 dtypes")
zeros = lambda *shape: torch.zeros(*shape, device=DEVICE, dtype=torch.float16)
tutorial.show_refusals(
    "attention()",
    {
        "3-D q": lambda: attention(zeros(2, 8, 16), zeros(2, 8, 16), zeros(2, 8, 16)),
        "head dims differ": lambda: attention(
            zeros(1, 2, 8, 64), *[zeros(1, 2, 8, 32)] * 2
        ),
        "head dim 256": lambda: attention(*[zeros(1, 2, 8, 256)] * 3),
        "dtypes differ": lambda: attention(
            zeros(1, 2, 8, 64), *[zeros(1, 2, 8, 64).float()] * 2
        ),
        "no keys": lambda: attention(zeros(1, 2, 8, 64), *[zeros(1, 2, 0, 64)] * 2),
    },
)

# %%
# Benchmarks
# ----------
# 16,384 tokens split into batches of sequences of N = 512 to 16,384, with 2,048 channels
# (16 heads of 128 or 32 of 64), causal and not, bf16 and fp16; the forward, and the backward
# alone (``torch.autograd.grad`` of a kept graph). Peers: SDPA as PyTorch picks (``torch``,
# cuDNN's kernel on the H100), SDPA held to FlashAttention-2 (``torch (flash)``) and to cuDNN,
# and ``torch.compile`` of the naive attention. TFLOP/s of the FLOPs above (causal: half),
# GPU time of CUDA-graph replays; the dashed line is cuBLAS's fp16 product at 4096³. A quick
# GPU run measures bf16 at head dim 128, with the kernels the check compiled, and shows the
# other cases as recorded: each would compile kernels of its own (``STEPKERNELS_FULL=1``
# measures them all).

TOKENS = tutorial.choose(gpu=16384, cpu=32)
CHANNELS = tutorial.choose(gpu=2048, cpu=256)  # the interpreter: 2 or 4 heads
SEQUENCES = [512, 1024, 2048, 4096, 8192, 16384]
BACKENDS = {
    "torch (flash)": SDPBackend.FLASH_ATTENTION,
    "torch (cudnn)": SDPBackend.CUDNN_ATTENTION,
}
PROVIDERS = ["triton", "torch", *BACKENDS, "torch.compile"]
# What a quick run measures, by head dim: the rest it shows as recorded.
QUICK_DTYPES = {128: (torch.bfloat16,), 64: ()}


def attention_call(provider):
    if provider == "triton":
        return attention
    if provider == "torch.compile":  # the specification, compiled for these shapes
        return bench.compile_static(check_attention.naive_attention)
    return check_attention.sdpa(BACKENDS.get(provider) if tutorial.ON_GPU else None)


def make_attention_call(provider, n, dtype, head_dim, causal, backward):
    shape = (TOKENS // n, CHANNELS // head_dim, n, head_dim)
    q, k, v, grad_out = (torch.randn(shape, device=DEVICE, dtype=dtype) for _ in "qkvg")
    function = attention_call(provider)
    if not backward:
        return lambda: function(q, k, v, causal)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = function(*inputs, causal)  # the backward alone, of this one graph, each call
    return lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)


def attention_benchmark(head_dim, causal, backward):  # one of the 8 cases below
    direction = "backward" if backward else "forward"
    name = f"attention-{direction}-d{head_dim}" + ("-causal" if causal else "")
    per_token = 4 * CHANNELS / (2 if causal else 1) * (2.5 if backward else 1)  # x N
    return bench.Benchmark(
        name=name,
        x_name="N (sequence), 16,384 tokens",
        x_values=SEQUENCES,  # on a GPU
        providers=PROVIDERS,
        unit="TFLOP/s",
        dtypes=(torch.bfloat16, torch.float16),
        make=lambda p, n, dtype: make_attention_call(
            p, n, dtype, head_dim, causal, backward
        ),
        work=lambda n, dtype: per_token * TOKENS * n,
        smoke_x=32,
        headline_x=4096,
        quick_dtypes=QUICK_DTYPES[head_dim],
    )


attention_results = {}
for case in itertools.product((128, 64), (False, True), (False, True)):
    benchmark = attention_benchmark(*case)
    results = bench.run(benchmark, draw=False)  # summarized below, not one by one
    if results:
        live = (results.measured, results.measured_env)  # a quick run's, as markers
        bench.plot(benchmark, results.points, results.env, results.live, *live)
    attention_results[benchmark.name] = results

# %%
# Where we stand
# --------------
# One line per benchmark, bf16 | fp16, over the six sequence lengths: our TFLOP/s; at how
# many of the lengths a peer ran we match or beat FlashAttention-2 (SDPA held to its flash
# backend) and ``torch.compile`` of the naive attention, the floor we set; and our share of
# cuDNN's kernel, what SDPA picks on the H100.


def standing(results, dtype):
    """The four cells of a benchmark's line for ``dtype``."""
    xs = sorted({p.x for p in results.points if p.provider == "triton"})
    ours = [results.value("triton", x, dtype) for x in xs]
    ran = lambda peer: [x for x in xs if results.point(peer, x, dtype)]
    ahead = lambda peer: sum(
        results.ratio("triton", peer, x, dtype) >= 1 for x in ran(peer)
    )
    shares = [
        results.ratio("triton", "torch (cudnn)", x, dtype) for x in ran("torch (cudnn)")
    ]
    return [
        f"{min(ours):,.0f}-{max(ours):,.0f}",
        f"{ahead('torch (flash)')}/{len(ran('torch (flash)'))}",
        f"{ahead('torch.compile')}/{len(ran('torch.compile'))}",
        f"{min(shares):.0%}-{max(shares):.0%}",
    ]


shown = {name: r for name, r in attention_results.items() if r}
if shown:
    print(
        "Attention, bf16 | fp16, " + "; ".join(sorted({r.how for r in shown.values()}))
    )
    columns = {"ours, TFLOP/s": 19, "≥ FA-2": 11, "≥ compile": 11, "share of cuDNN": 21}
    print(" " * 22 + "".join(f"{name:>{width}}" for name, width in columns.items()))
    for name, results in shown.items():
        cells = zip(
            *(standing(results, d) for d in ("bfloat16", "float16")), strict=True
        )
        line = "".join(
            f"{' | '.join(pair):>{width}}"
            for pair, width in zip(cells, columns.values(), strict=True)
        )
        print(f"  {name.removeprefix('attention-'):<20}{line}")
for name in ("attention-forward-d128", "attention-backward-d128"):
    if results := attention_results[name]:
        print(results.as_called("triton", "torch", 1024, "bfloat16"))

# %%
# The table has us ahead of FlashAttention-2, and of ``torch.compile`` wherever it writes
# the scores: everywhere but in the non-causal forward, which it recognizes and hands to
# SDPA, cuDNN's kernel. cuDNN's kernel is ahead of ours at most points. Kernels at that
# level on Hopper, FlashAttention-3 among them, specialize warps: producer warps issue the
# TMA copies while two consumer warp groups take turns on the tensor cores and the
# exponentials. Ours do the two in turn, overlapped only across the programs an SM holds;
# Triton 3.6's ``warp_specialize`` did not make our forward faster. Called from Python, our
# functions cost the CPU more than SDPA (the two calls printed above): up to twelve
# descriptors a backward, and launches through Triton's own path, since chapter 08's lean
# launcher does not take descriptors yet.
#
# Each benchmark at N = 4,096, every provider, GPU time and the call from Python:

for results in shown.values():
    bench.summarize(results.bench, results.points, results.env, results.live)

# %%
# What we learned
# ---------------
# * Fused attention is a matmul with a softmax in its loop: O(N D) bytes for O(N² D) FLOPs,
#   and the exponentials compete with the tensor cores for time.
# * The online softmax needs one pass over the keys; L lets the backward rebuild P.
# * Masks cost only where the mask is; descriptors handle the ragged edges for free.
# * A backward split by what each program owns needs no atomics and repeats bit for bit.
#
# The sweep behind the launch rules, and the variants that lost (warp specialization, lazy
# rescaling, descriptors made in the kernel), are in ``lab/attention_sweep.py`` and
# ``lab/NOTES.md``.
#
# Exercises
# ---------
# 1. Add dQ to the key-block kernel with ``tl.atomic_add`` into an fp32 buffer, drop the
#    query kernel, and time it: how much faster, and how far apart are two runs' dQ?
# 2. Grouped-query attention: let k and v have fewer heads than q (each serves
#    ``heads // kv_heads`` query heads). What changes in the forward, and in dK, dV?
# 3. Add an ALiBi bias, a slope per head times (j - i), to the scores: where does it go so
#    that the unmasked blocks stay cheap?
