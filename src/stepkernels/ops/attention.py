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
from stepkernels.runtime.tiles import dot_precision
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2 e)
# The interpreter's tl.dot cannot take bf16 (docs/running.rst): fp32 tiles there.
UPCAST = tl.constexpr(INTERPRET)


NO_WINDOW = 2**30  # a window past every sequence: none


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
def store_tile(heads, place, tile, VARLEN: tl.constexpr):
    """``tile`` at ``place`` (batch, head, heads of the tensor, row, end). Through the
    descriptor ``heads``, which drops rows and columns past the tensor's end; packed
    sequences (VARLEN) end before the tensor does, so there ``heads`` is a pointer to a
    (total, heads, HEAD_DIM) tensor and the rows from ``end`` on, the next sequence's,
    are masked."""
    batch, head, n_heads, row, end = place
    if VARLEN:
        rows = row + tl.arange(0, tile.shape[0])
        columns = tl.arange(0, tile.shape[1])
        offsets = (rows.to(tl.int64) * n_heads + head) * tile.shape[1]
        pointers = heads + offsets[:, None] + columns[None, :]
        tl.store(pointers, tile.to(heads.dtype.element_ty), rows[:, None] < end)
    else:
        tile = tl.reshape(tile, [1, 1, tile.shape[0], tile.shape[1]])
        heads.store([batch, head, row, 0], tile.to(heads.dtype))


@triton.jit
def visible(queries, keys, n_q, n_kv, window, CAUSAL: tl.constexpr):
    """Which pairs (query i, key j) count, i and j broadcast to a tile's shape: i < n_q,
    j < n_kv and, if causal, i - window < j <= i."""
    keep = (queries < n_q) & (keys < n_kv)
    if CAUSAL:
        keep &= (keys <= queries) & (keys > queries - window)
    return keep


@triton.jit
def attend(
    state, block, key_side, lo, hi, scale_log2, MASK: tl.constexpr, TILING: tl.constexpr
):
    """The online softmax of a block of queries over the key blocks [lo, hi): ``state``
    (acc, row sum, row max) updated. ``block``: the Q tile and its rows; ``key_side``:
    the descriptors of K and V, the (batch, kv head), the first key's row and the number
    of keys, the window. MASK: keep only the keys ``visible`` says, in the blocks where
    some are not."""
    acc, row_sum, row_max = state
    q, offs_m, n_q = block
    keys, values, batch, head, kv_start, n_kv, window = key_side
    for start_n in tl.range(lo, hi, TILING.BLOCK):
        k = load_tile(keys, batch, head, kv_start + start_n)
        scores = tl.dot(q, tl.trans(k), input_precision=TILING.PRECISION)
        if MASK:
            offs_n = start_n + tl.arange(0, TILING.BLOCK)
            pairs = (offs_m[:, None], offs_n[None, :], n_q, n_kv, window)
            scores = tl.where(visible(*pairs, TILING.CAUSAL), scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * scale_log2)
        base = new_max
        if MASK:  # a row with no key yet (a window's left edge): -inf - (-inf) is NaN
            base = tl.where(new_max == -float("inf"), 0.0, new_max)
        p = tl.exp2(scores * scale_log2 - base[:, None])  # one FMA a score
        alpha = tl.exp2(row_max - base)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = load_tile(values, batch, head, kv_start + start_n)
        acc = tl.dot(
            p.to(v.dtype), v, acc * alpha[:, None], input_precision=TILING.PRECISION
        )
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit
def key_blocks(start_m, n_kv, window, BLOCK_M, BLOCK_N, CAUSAL: tl.constexpr):
    """The key blocks a block of queries walks, [lo, hi), split at ``band`` and ``end``:
    [lo, band) the window's left edge and [end, hi) the diagonal and the ragged last
    block are masked; every query of the block sees every key of [band, end)."""
    whole = n_kv // BLOCK_N * BLOCK_N
    if CAUSAL:
        end = tl.minimum(start_m // BLOCK_N * BLOCK_N, whole)
        hi = tl.minimum(start_m + BLOCK_M, n_kv)
        lo = tl.minimum(tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N, end)
        # The first block past every row's left edge, i - window < j for the last row
        band = tl.cdiv(start_m + BLOCK_M - window, BLOCK_N) * BLOCK_N
        band = tl.minimum(tl.maximum(band, lo), end)
    else:
        lo, band, end, hi = 0, 0, whole, n_kv
    return lo, band, end, hi


@triton.jit
def sequence(
    pair, n_heads, n_q, n_kv, cu_seqlens_q, cu_seqlens_k, VARLEN: tl.constexpr
):
    """The (batch, head) that axis 1 of the grid gives a program, and where its queries
    and keys start and how many there are. Packed sequences (VARLEN) are rows
    [start, start + length) of batch 0, their starts in the cumulative lengths."""
    batch, head = pair // n_heads, pair % n_heads
    q_start, kv_start = 0, 0
    if VARLEN:  # batch counts sequences
        q_start = tl.load(cu_seqlens_q + batch)
        kv_start = tl.load(cu_seqlens_k + batch)
        n_q = tl.load(cu_seqlens_q + batch + 1) - q_start
        n_kv = tl.load(cu_seqlens_k + batch + 1) - kv_start
        batch = 0
    return batch, head, q_start, n_q, kv_start, n_kv


@triton.jit
def query_block(group, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """This program's first query, and which of its kv head's ``group`` query heads it
    takes: axis 0 of the grid counts query blocks, each ``group`` times, so the programs
    that read the same K and V tiles run side by side. Causal programs take the longest
    rows first."""
    block = tl.program_id(0) // group
    if CAUSAL:
        block = tl.num_programs(0) // group - 1 - block
    return block * BLOCK_M, tl.program_id(0) % group


@lean  # cheap repeated launches, descriptors too: chapter 08
@triton.jit
def attention_forward_kernel(
    queries,  # descriptors of (B, H, N, D) tensors: Q, K and V (H / group heads), O
    keys,
    values,
    outputs,  # packed sequences: a pointer to O, (total, H, HEAD_DIM)
    lse_ptr,  # (B x H, q_rows) fp32: the log-sum-exp of each row, for the backward
    cu_seqlens_q,  # packed: where each sequence starts, int32; else None
    cu_seqlens_k,
    n_heads,
    group,  # query heads a kv head serves
    q_rows,  # N of Q and K (packed: the total)
    kv_rows,
    window,  # causal: query i sees keys j > i - window
    scale_log2,  # softmax scale x log2(e)
    BLOCK_M: tl.constexpr,  # queries a program
    BLOCK_N: tl.constexpr,  # keys a step
    HEAD_DIM: tl.constexpr,  # D padded to a power of two
    CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences
    PRECISION: tl.constexpr,
):
    start_m, member = query_block(group, BLOCK_M, CAUSAL)
    starts = (cu_seqlens_q, cu_seqlens_k)
    batch, kv_head, q_start, n_q, kv_start, n_kv = sequence(
        tl.program_id(1), n_heads // group, q_rows, kv_rows, *starts, VARLEN
    )
    head = kv_head * group + member
    if start_m >= n_q:  # packed: past the end of a sequence shorter than the longest
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = load_tile(queries, batch, head, q_start + start_m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    state, block = (acc, row_sum, row_max), (q, offs_m, n_q)
    key_side = (keys, values, batch, kv_head, kv_start, n_kv, window)
    TILING: tl.constexpr = Tiling(BLOCK_N, CAUSAL, PRECISION)
    # The window's left edge, masked; whole blocks no row of ours masks; the diagonal
    # and the ragged end, masked. Blocks outside the band are not visited.
    lo, band, end, hi = key_blocks(start_m, n_kv, window, BLOCK_M, BLOCK_N, CAUSAL)
    state = attend(state, block, key_side, lo, band, scale_log2, True, TILING)
    state = attend(state, block, key_side, band, end, scale_log2, False, TILING)
    acc, row_sum, row_max = attend(
        state, block, key_side, end, hi, scale_log2, True, TILING
    )
    seen = row_sum > 0  # a row may see no key (a window past the last): 0, as SDPA
    row_sum = tl.where(seen, row_sum, 1.0)
    place = (batch, head, n_heads, q_start + start_m, q_start + n_q)
    store_tile(outputs, place, acc / row_sum[:, None], VARLEN)
    lse = tl.where(seen, row_max + tl.log2(row_sum), float("inf"))  # base 2, scaled
    stats = (batch * n_heads + head).to(tl.int64) * q_rows + q_start
    tl.store(lse_ptr + stats + offs_m, lse, offs_m < n_q)


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
    ``query_side``: the descriptors of Q and dO, L and δ of the head, the (batch, head),
    the first query's row, the number of queries and the window. MASK: keep only the
    pairs ``visible`` says (rows past the end of packed sequences are the next one's)."""
    dk, dv = state
    k, v, offs_n, n_kv = block
    queries, grads, lse_row, delta_row, batch, head, q_start, n_q, window = query_side
    for start_m in tl.range(lo, hi, TILING.BLOCK):
        offs_m = start_m + tl.arange(0, TILING.BLOCK)
        q = load_tile(queries, batch, head, q_start + start_m)
        do = load_tile(grads, batch, head, q_start + start_m)
        lse = tl.load(lse_row + offs_m, offs_m < n_q, 0.0)
        delta = tl.load(delta_row + offs_m, offs_m < n_q, 0.0)
        scores = tl.dot(k, tl.trans(q), input_precision=TILING.PRECISION)
        p = tl.exp2(scores * scale_log2 - lse[None, :])
        if MASK:
            pairs = (offs_m[None, :], offs_n[:, None], n_q, n_kv, window)
            p = tl.where(visible(*pairs, TILING.CAUSAL), p, 0.0)
        dv = tl.dot(p.to(do.dtype), do, dv, input_precision=TILING.PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=TILING.PRECISION)
        ds = p * (dp - delta[None, :])
        dk = tl.dot(ds.to(q.dtype), q, dk, input_precision=TILING.PRECISION)
    return dk, dv


@triton.jit
def query_blocks(start_n, n_q, window, BLOCK_M, BLOCK_N, CAUSAL: tl.constexpr):
    """The query blocks a block of keys walks, [lo, hi), split at ``diagonal`` and
    ``band``: [lo, diagonal) the diagonal and [band, hi) the window's right edge and the
    ragged last block are masked; every query of [diagonal, band) sees every key."""
    lo, diagonal, hi = 0, 0, n_q
    if CAUSAL:  # queries i >= j, and i < j + window
        lo = start_n // BLOCK_M * BLOCK_M
        hi = tl.minimum(n_q, start_n + BLOCK_N + window - 1)
        diagonal = tl.maximum(
            tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, hi), lo
        )
    band = tl.minimum((start_n + window) // BLOCK_M * BLOCK_M, n_q // BLOCK_M * BLOCK_M)
    return lo, diagonal, tl.maximum(band, diagonal), hi


@lean
@triton.jit
def attention_key_grads_kernel(
    queries,  # descriptors: Q, K, V, dO, and dK, dV written (packed: pointers)
    keys,
    values,
    grads,
    key_grads,
    value_grads,
    lse_ptr,  # (B x H, q_rows) fp32: L from the forward, δ from the query programs
    delta_ptr,
    cu_seqlens_q,  # packed: where each sequence starts, int32; else None
    cu_seqlens_k,
    n_kv_heads,
    group,  # query heads a kv head serves
    q_rows,  # N of Q and K (packed: the total)
    kv_rows,
    window,
    scale_log2,  # softmax scale x log2(e)
    sm_scale,
    BLOCK_M: tl.constexpr,  # queries a step
    BLOCK_N: tl.constexpr,  # keys a program
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    starts = (cu_seqlens_q, cu_seqlens_k)
    batch, kv_head, q_start, n_q, kv_start, n_kv = sequence(
        tl.program_id(1), n_kv_heads, q_rows, kv_rows, *starts, VARLEN
    )
    if start_n >= n_kv:  # packed: past the end of a sequence shorter than the longest
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k, v = (
        load_tile(keys, batch, kv_head, kv_start + start_n),
        load_tile(values, batch, kv_head, kv_start + start_n),
    )
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    block = (k, v, offs_n, n_kv)
    TILING: tl.constexpr = Tiling(BLOCK_M, CAUSAL, PRECISION)
    lo, diagonal, band, hi = query_blocks(
        start_n, n_q, window, BLOCK_M, BLOCK_N, CAUSAL
    )
    # dK and dV sum over the query heads this kv head serves: K and V stay loaded.
    for head in range(kv_head * group, kv_head * group + group):
        stats = (batch * n_kv_heads * group + head).to(tl.int64) * q_rows + q_start
        query_side = (queries, grads, lse_ptr + stats, delta_ptr + stats)
        query_side += (batch, head, q_start, n_q, window)
        state = key_block_grads(
            (dk, dv), block, query_side, lo, diagonal, scale_log2, True, TILING
        )
        state = key_block_grads(
            state, block, query_side, diagonal, band, scale_log2, False, TILING
        )
        dk, dv = key_block_grads(
            state, block, query_side, band, hi, scale_log2, True, TILING
        )
    place = (batch, kv_head, n_kv_heads, kv_start + start_n, kv_start + n_kv)
    store_tile(key_grads, place, dk * sm_scale, VARLEN)
    store_tile(value_grads, place, dv, VARLEN)


@triton.jit
def query_block_grad(
    dq, block, key_side, lo, hi, scale_log2, MASK: tl.constexpr, TILING: tl.constexpr
):
    """dQ of a block of queries over the key blocks [lo, hi). ``block``: the Q and dO
    tiles, L, δ, the rows and the number of queries; ``key_side`` and MASK: as
    ``attend``'s. Keys past the end read as zeros, but exp2(0 - lse) overflows for a row
    whose scores are all far below zero, and inf x 0 is NaN: they are masked too."""
    q, do, lse, delta, offs_m, n_q = block
    keys, values, batch, head, kv_start, n_kv, window = key_side
    for start_n in tl.range(lo, hi, TILING.BLOCK):
        k = load_tile(keys, batch, head, kv_start + start_n)
        v = load_tile(values, batch, head, kv_start + start_n)
        scores = tl.dot(q, tl.trans(k), input_precision=TILING.PRECISION)
        p = tl.exp2(scores * scale_log2 - lse[:, None])
        if MASK:
            offs_n = start_n + tl.arange(0, TILING.BLOCK)
            pairs = (offs_m[:, None], offs_n[None, :], n_q, n_kv, window)
            p = tl.where(visible(*pairs, TILING.CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=TILING.PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=TILING.PRECISION)
    return dq


@lean
@triton.jit
def attention_query_grad_kernel(
    queries,  # descriptors: Q, K, V, O, dO, and dQ written (packed: a pointer)
    keys,
    values,
    outputs,
    grads,
    query_grads,
    lse_ptr,  # (B x H, q_rows) fp32: L from the forward; δ written for the key programs
    delta_ptr,
    cu_seqlens_q,  # packed: where each sequence starts, int32; else None
    cu_seqlens_k,
    n_heads,
    group,
    q_rows,
    kv_rows,
    window,
    scale_log2,  # softmax scale x log2(e)
    sm_scale,
    BLOCK_M: tl.constexpr,  # queries a program
    BLOCK_N: tl.constexpr,  # keys a step
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m, member = query_block(group, BLOCK_M, CAUSAL)
    starts = (cu_seqlens_q, cu_seqlens_k)
    batch, kv_head, q_start, n_q, kv_start, n_kv = sequence(
        tl.program_id(1), n_heads // group, q_rows, kv_rows, *starts, VARLEN
    )
    head = kv_head * group + member
    if start_m >= n_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q, do = (
        load_tile(queries, batch, head, q_start + start_m),
        load_tile(grads, batch, head, q_start + start_m),
    )
    o = load_tile(outputs, batch, head, q_start + start_m).to(tl.float32)
    delta = tl.sum(o * do.to(tl.float32), axis=1)  # for the key programs, too
    stats = (batch * n_heads + head).to(tl.int64) * q_rows + q_start
    tl.store(delta_ptr + stats + offs_m, delta, offs_m < n_q)
    lse = tl.load(lse_ptr + stats + offs_m, offs_m < n_q, 0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block = (q, do, lse, delta, offs_m, n_q)
    key_side = (keys, values, batch, kv_head, kv_start, n_kv, window)
    TILING: tl.constexpr = Tiling(BLOCK_N, CAUSAL, PRECISION)
    lo, band, end, hi = key_blocks(start_m, n_kv, window, BLOCK_M, BLOCK_N, CAUSAL)
    dq = query_block_grad(dq, block, key_side, lo, band, scale_log2, True, TILING)
    dq = query_block_grad(dq, block, key_side, band, end, scale_log2, False, TILING)
    dq = query_block_grad(dq, block, key_side, end, hi, scale_log2, True, TILING)
    place = (batch, head, n_heads, q_start + start_m, q_start + n_q)
    store_tile(query_grads, place, dq * sm_scale, VARLEN)


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
    rows = torch.empty(*shape[:3], padded, dtype=dtype, device=device)
    return rows if padded == shape[3] else rows[..., : shape[3]]  # no view to make


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


def empty_outputs(t: torch.Tensor, packing, like=None) -> torch.Tensor:
    """A new tensor shaped as ``t``, for O or a gradient: as ``empty_heads`` makes it,
    or for packed sequences a (1, H, total, D) view of a (total, H, HEAD_DIM) tensor,
    which the kernels write with masked stores (``store_tile``)."""
    if packing is None:
        return empty_heads(t.shape, t.dtype, t.device, like)
    _, n_heads, total, head_dim = t.shape
    padded = padded_head_dim(head_dim)
    rows = torch.empty(total, n_heads, padded, dtype=t.dtype, device=t.device)
    return rows[..., :head_dim].unsqueeze(0).transpose(1, 2)


class Packing(NamedTuple):
    """Packed sequences, as ``flash_attn_varlen_func`` takes them: sequence s is rows
    [cu_seqlens[s], cu_seqlens[s + 1]) of (total, H, D) tensors, which the kernels see
    as (1, H, total, D) views."""

    cu_seqlens_q: torch.Tensor  # int32, the sequences + 1 cumulative lengths
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int  # the longest: the grid has a program per block of it
    max_seqlen_k: int


def check_packing(packing: Packing, total_q: int, total_k: int):
    """The cumulative lengths' values, read on the host (a synchronization): a wrong one
    would have programs read another sequence's rows, or leave rows unwritten."""
    lengths_of = {}
    for side, total in (("q", total_q), ("k", total_k)):
        starts = getattr(packing, f"cu_seqlens_{side}").tolist()
        lengths = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        if starts[0] != 0 or starts[-1] != total or min(lengths) < 0:
            raise ValueError(
                f"cu_seqlens_{side} must start at 0, never decrease and end at the "
                f"{total} rows of {side}, got {starts}"
            )
        if max(lengths) > getattr(packing, f"max_seqlen_{side}"):
            raise ValueError(
                f"max_seqlen_{side} must be at least the longest sequence, "
                f"{max(lengths)}, got {getattr(packing, f'max_seqlen_{side}')}"
            )
        lengths_of[side] = lengths
    for s, (queries, keys) in enumerate(zip(*lengths_of.values(), strict=True)):
        if keys == 0 and queries > 0:
            raise ValueError(f"sequence {s} has queries but no keys: pass at least one")


def keys_seen(window) -> int:
    """The kernels' window: none is one past every sequence."""
    return min(window or NO_WINDOW, NO_WINDOW)


def launch_extent(q, k, packing):
    """(sequences, rows of the longest query and key sequences) the grids cover, and the
    sequences' starts (None, None unless packed)."""
    if packing is None:
        return q.shape[0], q.shape[2], k.shape[2], (None, None)
    starts = (packing.cu_seqlens_q, packing.cu_seqlens_k)
    sequences = len(packing.cu_seqlens_q) - 1
    return sequences, packing.max_seqlen_q, packing.max_seqlen_k, starts


def attention_forward(
    q, k, v, causal, sm_scale, window=None, packing=None, launch=None
):
    """O and the base-2 log-sum-exp of each row, for descriptor-ready (B, H, N, D) q and
    k, v of H / group heads; packed sequences: ``packing``, and (1, H, total, D) q, k, v."""
    batch, n_heads, n_q, head_dim = q.shape
    if packing is not None:
        check_packing(packing, n_q, k.shape[2])
    o = empty_outputs(q, packing, like=q)
    lse = torch.empty(batch * n_heads, n_q, device=q.device, dtype=torch.float32)
    padded = padded_head_dim(head_dim)
    launch = launch or default_launches(padded, q.element_size(), causal)[0]
    m, n = launch.block_m, launch.block_n
    sequences, longest_q, _, starts = launch_extent(q, k, packing)
    group, kv_heads = n_heads // k.shape[1], k.shape[1]
    attention_forward_kernel[(cdiv(longest_q, m) * group, sequences * kv_heads)](
        heads(q, m),
        heads(k, n),
        heads(v, n),
        heads(o, m) if packing is None else o,
        lse,
        *starts,
        n_heads,
        group,
        n_q,
        k.shape[2],
        keys_seen(window),
        sm_scale * LOG2E,
        BLOCK_M=m,
        BLOCK_N=n,
        HEAD_DIM=padded,
        CAUSAL=causal,
        VARLEN=packing is not None,
        PRECISION=dot_precision(q.dtype),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return o, lse


def attention_backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    causal,
    sm_scale,
    window=None,
    packing=None,
    launches=None,
    grads=None,
):
    """dQ, dK, dV for descriptor-ready tensors; ``launches``: (key, query) gradients;
    ``grads``: descriptor-ready dQ, dK, dV to write into (a caller's layout), else new."""
    batch, n_heads, n_q, head_dim = q.shape
    padded = padded_head_dim(head_dim)
    _, key_launch, query_launch = default_launches(padded, q.element_size(), causal)
    key_launch, query_launch = launches or (key_launch, query_launch)
    new = (empty_outputs(t, packing) for t in (q, k, v))
    dq, dk, dv = new if grads is None else grads
    written = (lambda t, block: t) if packing else heads  # packed: pointers
    delta = torch.empty_like(lse)
    sequences, longest_q, longest_k, starts = launch_extent(q, k, packing)
    group, kv_heads = n_heads // k.shape[1], k.shape[1]
    shape = (group, n_q, k.shape[2], keys_seen(window))
    scales = (sm_scale * LOG2E, sm_scale)
    options = dict(
        HEAD_DIM=padded,
        CAUSAL=causal,
        VARLEN=packing is not None,
        PRECISION=dot_precision(q.dtype),
    )
    m, n = query_launch.block_m, query_launch.block_n  # first: it writes δ
    attention_query_grad_kernel[(cdiv(longest_q, m) * group, sequences * kv_heads)](
        heads(q, m),
        heads(k, n),
        heads(v, n),
        heads(o, m),
        heads(do, m),
        written(dq, m),
        lse,
        delta,
        *starts,
        n_heads,
        *shape,
        *scales,
        BLOCK_M=m,
        BLOCK_N=n,
        **options,
        num_warps=query_launch.num_warps,
        num_stages=query_launch.num_stages,
    )
    m, n = key_launch.block_m, key_launch.block_n
    attention_key_grads_kernel[(cdiv(longest_k, n), sequences * kv_heads)](
        heads(q, m),
        heads(k, n),
        heads(v, n),
        heads(do, m),
        written(dk, n),
        written(dv, n),
        lse,
        delta,
        *starts,
        kv_heads,
        *shape,
        *scales,
        BLOCK_M=m,
        BLOCK_N=n,
        **options,
        num_warps=key_launch.num_warps,
        num_stages=key_launch.num_stages,
    )
    return dq, dk, dv


def forward_ready(q, k, v, causal, sm_scale, window, packing=None):
    """(q, k, v as the kernels read them, O, lse): copies of q, k, v where a descriptor
    cannot describe them."""
    q, k, v = ready(q), ready(k), ready(v)
    return q, k, v, *attention_forward(q, k, v, causal, sm_scale, window, packing)


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, causal, sm_scale, window, packing, key=None, planned=None
    ):
        q, k, v, o, lse = (planned or forward_ready)(
            q, k, v, causal, sm_scale, window, packing
        )
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options, ctx.key = (causal, sm_scale, window, packing), key
        return o

    @staticmethod
    def backward(ctx, do):
        refuse_double_backward("attention", "F.scaled_dot_product_attention")
        q, k, v, o, lse = ctx.saved_tensors
        key = ctx.key if type(do) is torch.Tensor and lean_now() else None
        if key is not None:  # a repeated call: dO's layout too
            key = (key, layout(do))
            planned = BACKWARD_PLANS.get(key)
            if planned is not None:
                return *planned(q, k, v, o, lse, do), None, None, None, None, None, None
        with recorded_launches(key is not None) as launches:
            ready_do = ready(do)
            grads = attention_backward(q, k, v, o, lse, ready_do, *ctx.options)
        if key is not None and ready_do is do:
            saved = (q, k, v, o, lse, do)
            BACKWARD_PLANS[key] = planned_backward(launches, saved, *grads)
        return *grads, None, None, None, None, None, None


# A repeated call launches its kernels bound (chapter 08), under a key of all that the
# first call checked and its launches read: q's, k's and v's layouts and device, the
# options, whether a gradient is wanted and fp32's precision (and, backward, dO's layout).
# A bound launch describes its new tensors as the first call's descriptors did.
FORWARD_PLANS, BACKWARD_PLANS = plan_cache(), plan_cache()


def planned_forward(launches, q, k, v, o, lse, options):
    """``forward_ready`` for one key, its launch bound; None where it cannot be (a copy
    of q, k or v, or a kernel not launched lean)."""
    bound = bound_launches(launches, (q, k, v, o, lse))
    if bound is None:
        return None
    launch, lse_shape = bound[0], lse.shape

    def forward_bound(q, k, v, *_):
        o = empty_heads(q.shape, q.dtype, q.device, like=q)
        lse = torch.empty(lse_shape, device=q.device, dtype=torch.float32)
        launch(q, k, v, o, lse)
        return q, k, v, o, lse

    forward_bound.options = options
    return forward_bound


def planned_backward(launches, saved, dq, dk, dv):
    """``attention_backward`` for one key, its two launches bound; None where they
    cannot be."""
    q, k, v, o, lse, do = saved
    delta = launches[0][2][7] if len(launches) == 2 else None
    expected = ((q, k, v, o, do, dq, lse, delta), (q, k, v, do, dk, dv, lse, delta))
    bound = None if delta is None else bound_launches(launches, *expected)
    if bound is None:
        return None
    query_launch, key_launch = bound

    def backward_bound(q, k, v, o, lse, do):
        dq, dk, dv = (empty_heads(t.shape, t.dtype, t.device) for t in (q, k, v))
        delta = torch.empty_like(lse)
        query_launch(q, k, v, o, do, dq, lse, delta)
        key_launch(q, k, v, do, dk, dv, lse, delta)
        return dq, dk, dv

    return backward_bound


def check_attention_inputs(q, k, v, causal, sm_scale, window=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, FLOAT_DTYPES)
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be (batch, heads, sequence, head_dim), got "
                f"{tuple(t.shape)}; from (B, N, H, D): .transpose(1, 2)"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        raise ValueError(
            f"k and v must have one shape, q the same batch and head dim (no other "
            f"value head dim): {shapes}"
        )
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads * (q_heads // max(kv_heads, 1)) != q_heads:
        raise ValueError(
            f"q's heads must be a multiple of k's and v's (each kv head serves as many "
            f"query heads), got {q_heads} and {kv_heads}"
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
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise TypeError(f"window must be a whole number or None, got {window!r}")
    if window is not None and (window < 1 or not causal):
        raise ValueError(
            f"window must be >= 1 and comes with causal=True (query i sees keys "
            f"i - window < j <= i), got window={window!r}, causal={causal}"
        )


def attend_heads(q, k, v, causal, sm_scale, window, packing=None):
    """attention and varlen_attention past their checks: through the compiler's
    operator (below), autograd, or the forward alone."""
    if torch.compiler.is_compiling():
        packed = packing or (None, None, 0, 0)
        return attention_op(q, k, v, causal, sm_scale, window, *packed)[0]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return AttentionFunction.apply(q, k, v, causal, sm_scale, window, packing)
    q, k, v = ready(q), ready(k), ready(v)
    return attention_forward(q, k, v, causal, sm_scale, window, packing)[0]


def nothing_to_attend(q, k, v):
    """SDPA's result where there is nothing to attend: an empty or zero tensor, with
    gradients."""
    return q.new_zeros(q.shape) + 0 * (q.sum() + k.sum() + v.sum())


def attention(q, k, v, causal=False, sm_scale=None, window=None):
    """``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
    scale=sm_scale, enable_gqa=True)`` for (batch, heads, sequence, head_dim) tensors in
    fp16, bf16 or fp32 (tf32 products unless
    ``torch.set_float32_matmul_precision("highest")``), with autograd. ``causal``: query i
    sees keys j <= i, as SDPA's ``is_causal``; ``window``: and only keys j > i - window.
    k and v may have fewer heads than q: query head h reads kv head h // (q heads / kv
    heads). Head dims up to 128."""
    fast = (
        type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
    )
    fast = fast and type(causal) is bool and type(sm_scale) in (float, int, type(None))
    fast = fast and type(window) in (int, type(None))
    fast = fast and not torch.compiler.is_compiling() and lean_now()
    if fast:  # a call seen before: checked then, its launches bound
        grad = q.requires_grad or k.requires_grad or v.requires_grad
        grad = grad and torch.is_grad_enabled()
        fp32 = q.dtype == torch.float32
        precision = torch.get_float32_matmul_precision() if fp32 else None
        key = (layout(q), layout(k), layout(v), causal)
        key = (*key, sm_scale, window, grad, precision)
        planned = FORWARD_PLANS.get(key)
        if planned is not None:
            if not grad:
                return planned(q, k, v)[3]
            return AttentionFunction.apply(
                q, k, v, *planned.options, None, key, planned
            )
    check_attention_inputs(q, k, v, causal, sm_scale, window)
    scale = q.shape[3] ** -0.5 if sm_scale is None else float(sm_scale)
    if q.numel() == 0:
        return nothing_to_attend(q, k, v)
    if not fast:
        return attend_heads(q, k, v, causal, scale, window)
    results = []  # what forward_ready made, to bind the launch to

    def recorded(*args):
        results.append(forward_ready(*args))
        return results[-1]

    options = (causal, scale, window)
    with recorded_launches() as launches:
        if grad:
            out = AttentionFunction.apply(q, k, v, *options, None, key, recorded)
        else:
            out = recorded(q, k, v, *options)[3]
    # The caller's q, k, v, not forward_ready's: where it copied them for the descriptors,
    # the launch read the copies, bound_launches finds other addresses, and nothing is bound.
    planned = results and planned_forward(launches, q, k, v, *results[0][3:], options)
    if planned:
        FORWARD_PLANS[key] = planned
    return out


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal=False,
    sm_scale=None,
    window=None,
):
    """``attention`` of packed sequences, as ``flash_attn_varlen_func`` takes them: q of
    (total_q, heads, head_dim), k and v of (total_k, kv heads, head_dim), sequence s at
    rows [cu_seqlens[s], cu_seqlens[s + 1]) (int32) of each; no query sees another
    sequence's keys. ``causal`` and ``window`` count within a sequence from its first
    row, as ``attention``'s (flash_attn aligns a causal mask to the last rows where the
    lengths differ). Returns (total_q, heads, head_dim)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, FLOAT_DTYPES)
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be (total, heads, head_dim), packed sequences, got "
                f"{tuple(t.shape)}; for (batch, heads, sequence, head_dim): attention"
            )
    for side, starts, longest in (
        ("q", cu_seqlens_q, max_seqlen_q),
        ("k", cu_seqlens_k, max_seqlen_k),
    ):
        check_tensor(starts, f"cu_seqlens_{side}", (torch.int32,))
        if starts.dim() != 1 or len(starts) < 2 or starts.shape != cu_seqlens_q.shape:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must be 1-D, one entry more than there "
                f"are sequences, got {tuple(cu_seqlens_q.shape)} and "
                f"{tuple(cu_seqlens_k.shape)}"
            )
        if not isinstance(longest, int) or isinstance(longest, bool):
            raise TypeError(f"max_seqlen_{side} must be an int, got {longest!r}")
        if longest < 0:
            raise ValueError(f"max_seqlen_{side} must be >= 0, got {longest}")
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)]  # (1, H, total, D)
    check_attention_inputs(*views, causal, sm_scale, window)
    scale = q.shape[2] ** -0.5 if sm_scale is None else float(sm_scale)
    if q.numel() == 0:
        return nothing_to_attend(q, k, v)
    packing = Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return attend_heads(*views, causal, scale, window, packing)[0].transpose(0, 1)


from torch import Tensor
from torch.library import custom_op


def packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The operators' last four arguments as a ``Packing``, or None (not packed)."""
    if cu_seqlens_q is None:
        return None
    return Packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@custom_op("stepkernels::attention", mutates_args=())
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    sm_scale: float,
    window: int | None = None,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> tuple[Tensor, Tensor]:
    packing = packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v = ready(q), ready(k), ready(v)
    return attention_forward(q, k, v, causal, sm_scale, window, packing)  # o, lse


@attention_op.register_fake
def _(q, k, v, causal, sm_scale, window=None, cu_seqlens_q=None, *_):
    lse = q.new_empty((q.shape[0] * q.shape[1], q.shape[2]), dtype=torch.float32)
    return empty_outputs(q, cu_seqlens_q, like=q), lse


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
    window: int | None = None,
    starts: Tensor | None = None,  # packed: cu_seqlens_q and cu_seqlens_k, stacked
    longest: list[int] | None = None,  # packed: max_seqlen_q and max_seqlen_k
) -> tuple[Tensor, Tensor, Tensor]:
    packing = None if starts is None else packed(*starts, *longest)
    q, k, v, o, do = (ready(t) for t in (q, k, v, o, do))
    return attention_backward(q, k, v, o, lse, do, causal, sm_scale, window, packing)


@attention_backward_op.register_fake
def _(q, k, v, o, lse, do, causal, sm_scale, window=None, starts=None, longest=None):
    return tuple(empty_outputs(t, starts) for t in (q, k, v))


def attention_setup(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.sm_scale, ctx.window, cu_q, cu_k, *longest = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
    ctx.longest = longest  # max_seqlen_q, max_seqlen_k
    ctx.set_materialize_grads(False)  # lse gets no gradient


def attention_op_backward(ctx, do, _lse_grad):
    refuse_double_backward("attention", "F.scaled_dot_product_attention")
    *tensors, cu_q, cu_k = ctx.saved_tensors
    starts = None if cu_q is None else torch.stack((cu_q, cu_k))
    options = (ctx.causal, ctx.sm_scale, ctx.window, starts, ctx.longest)
    grads = attention_backward_op(*tensors, do, *options)
    return *grads, *[None] * 7


attention_op.register_autograd(attention_op_backward, setup_context=attention_setup)
