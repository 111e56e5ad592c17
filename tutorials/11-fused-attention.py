r"""
Fused attention
===============

We write attention, softmax(Q Kᵀ · scale) V, as kernels that never hold the N x N scores: a
forward that streams keys and values past a block of queries, and a backward that rebuilds
what it needs from the forward's log-sum-exp. What you will learn:

* why naive attention is bound by memory and fused attention by the tensor cores;
* chapter 02's online softmax in a tiled kernel, the scale folded into exp2;
* which blocks a causal mask touches; tiles through TMA descriptors, zeros past the edges;
* FlashAttention-2's split of the backward, without atomics: the same bits on every run;
* grouped-query heads, sliding windows and packed sequences of many lengths, from the same
  three kernels, with loop bounds and offsets rather than copies.

Prerequisites: chapter 02 (the online softmax), chapter 05 (autograd), chapter 07 (TMA).
"""

# %%
# Setup
# -----

import itertools

from stepkernels.lessons import bench, check_attention, tutorial
import torch
from torch.nn.attention import SDPBackend
import torch.nn.functional as F

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
# Three variants change what a program reads, not how it computes:
#
# * **Grouped heads (GQA; MQA with one kv head)**: k and v have H / g heads, and query
#   head h reads kv head h // g, as SDPA's ``enable_gqa``. The K and V bytes shrink g
#   times; the FLOPs do not.
# * **A sliding window**: with ``window=W`` (causal only), query i sees keys
#   i - W < j <= i. ``key_blocks`` splits a program's key loop in three: the band's left
#   edge, masked; the blocks every one of its rows sees whole; the diagonal, masked. Blocks
#   left of the band are never loaded: N·W score pairs a head, not N²/2. A row that sees no
#   key (more queries than keys) gives 0, as SDPA.
# * **Packed sequences** (``varlen_attention``): (total, H, D) tensors, sequence s at rows
#   [cu_seqlens[s], cu_seqlens[s + 1]), seen by the descriptors as one (1, H, total, D)
#   batch. ``sequence`` reads a program's offsets and lengths; axis 0 of the grid covers
#   the longest sequence and programs past their own's end return at once. A tile past a
#   sequence's end holds the next sequence's rows, not zeros: the masks drop them, and O
#   is written with masked stores, not through the descriptor, whose bounds are the
#   whole tensor's.
#
# The helpers that walk blocks (``attend`` here, two more in the backward) take their
# arguments in groups, each a tuple: what they update (``state``), the block the program
# owns, the other side's descriptors with its (batch, head), first row, length and window,
# and the launch's compile-time choices as one ``Tiling``. Triton inlines them: the
# compiled kernel is the one a helper of sixteen loose arguments gave, instruction for
# instruction.

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
# for the key programs. Causal and windowed loops split as in the forward.
#
# With grouped heads, dK and dV of a kv head sum over its g query heads. A key program
# owns a block of one kv head and loops over the group's query heads, its K and V tiles
# loaded once and its dK, dV summed in registers: no k, v expanded to H heads, no
# reduction after. In the forward (and the dQ kernel), each query head's program loads
# its group's K and V itself; axis 0 of the grid counts each query block g times, one for
# each head of the group, so the g programs that read the same tiles start side by side
# and all but the first find them in L2. Reading each tile into the SM once per group
# would take a program of g query heads: the
# tile of K and V on chip, g accumulators of [BLOCK_M, D] (or one of [g·BLOCK_M, D] with
# the group's rows stacked), as many registers as a g times larger BLOCK_M (exercise 2).


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


# %%
# Launches, layouts and the autograd function
# -------------------------------------------
# Launch rules (blocks of queries x keys, warps, stages) are the fastest of a sweep on the
# H100 over blocks of 32 to 128, 4 or 8 warps and 1 to 4 stages. A tensor no descriptor
# can describe (last dimension not contiguous; D = 20 in fp16, rows of 40 bytes) is copied
# once, contiguous with rows padded to 16 bytes; a (B, N, H, D) tensor viewed as (B, H, N, D)
# is read in place, and O is then written in q's layout, as SDPA does: ``o.transpose(1, 2)``
# is the (B, N, H·D) input of the next projection without a copy. Under the interpreter the
# blocks are 16 x 16. A repeated call with the same layouts and options skips its checks and
# launch rules and replays its launches bound (chapter 08), making only its descriptors again.

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


# %%
# ``torch.compile`` sees attention as an operator of ``torch.library`` (chapter 08). Its
# kernels take TMA descriptors built on the host, which the compiler cannot trace into a graph,
# so this one is a ``custom_op``: opaque, called by the compiled graph as it is, with a fake
# implementation that gives the outputs' shapes and strides, and its derivative.

# @save ops/attention
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
# The variants against their references in fp64: grouped heads against SDPA's
# ``enable_gqa=True`` (4 query heads, 2 kv heads), a window of 20 keys against a boolean
# mask, and packed sequences of 30, 1 and the rest of the rows (``varlen_attention``) against
# SDPA one sequence at a time. ``tests/test_attention_variants.py`` has windows of one key
# to longer than the sequence, MQA, head dims 16 to 128 and sequences without queries.

n = tutorial.choose(gpu=300, cpu=40)
q, k, v = check_attention.inputs(1, 4, n, n, 64, torch.bfloat16, DEVICE)
k, v = k[:, ::2], v[:, ::2]  # 2 kv heads, each serving 2 query heads
check_attention.check(attention, q, k, v)
check_attention.check(attention, q, k, v, causal=True, window=20)
packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # (total, heads, head_dim)
starts = torch.tensor([0, 30, 31, n], dtype=torch.int32, device=DEVICE)
longest = int(starts.diff().max())
sequences = dict(cu_seqlens_q=starts, cu_seqlens_k=starts)
sequences |= dict(max_seqlen_q=longest, max_seqlen_k=longest)
check_attention.check(varlen_attention, *packed, causal=True, **sequences)
print("grouped heads, a window and packed sequences match their references")
tutorial.show_refusals(
    "attention(), varlen_attention()",
    {
        "3 kv heads for 4": lambda: attention(
            zeros(1, 4, 8, 64), *[zeros(1, 3, 8, 64)] * 2
        ),
        "window without causal": lambda: attention(*[zeros(1, 2, 8, 64)] * 3, window=4),
        "int64 cu_seqlens": lambda: varlen_attention(
            *packed, starts.long(), starts, n, n
        ),
        "cu_seqlens decreasing": lambda: varlen_attention(
            *packed, starts.flip(0), starts, n, n
        ),
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
# functions cost the CPU more than SDPA (the two calls printed above), though a repeated
# call's launches are bound as chapter 08 binds them, its descriptors rebuilt from the first
# call's fields: SDPA's call is C++ from end to end, ours is Python around an autograd
# ``Function``.
#
# Each benchmark at N = 4,096, every provider, GPU time and the call from Python:

for results in shown.values():
    bench.summarize(results.bench, results.points, results.env, results.live)

# %%
# Grouped heads, windows and packed sequences, measured
# -----------------------------------------------------
# Three variants, each forward and backward alone, bf16, head dim 128, 16 query heads and
# 16,384 tokens as above. Their TFLOP/s count only the *useful* FLOPs: 4 D for each (query,
# key) pair the variant keeps, in the forward, 2.5 times that in the backward, so a rate
# equal to the causal benchmarks' above is "as fast per useful FLOP".
#
# * ``attention-gqa``: causal, 4 kv heads (groups of 4), N = 512 to 16,384; N²/2 pairs a
#   head, as counted above. Peers: SDPA with ``enable_gqa=True``, as PyTorch picks and held
#   to FlashAttention-2.
# * ``attention-window``: a window of 1,024 keys, N = 2,048 to 16,384; 1,024 N - 1,024 ·
#   1,023 / 2 pairs a head (the first 1,023 rows see fewer). Peer: SDPA with the window as
#   a boolean mask, which its kernels read from memory (none takes a window).
# * ``attention-varlen``: not causal, packed sequences of lengths drawn uniformly from 1 to
#   twice the mean (x), to 16,384 tokens; Σ n² pairs a head. Peer: SDPA on a jagged nested
#   tensor of the same packing (``torch.nested``, which takes no causal mask). Our call
#   reads the cumulative lengths on the host to check them, a synchronization, so both
#   providers are timed as called from Python (do_bench), not replayed in a CUDA graph.

VARIANT_HEADS, VARIANT_HEAD_DIM = tutorial.choose(gpu=(16, 128), cpu=(4, 16))
WINDOW = tutorial.choose(gpu=1024, cpu=8)


def packed_lengths(mean):
    """Sequence lengths drawn uniformly from 1 to 2 x mean - 1 (one seed), cut to TOKENS."""
    generator, lengths = torch.Generator().manual_seed(0), []
    while sum(lengths) < TOKENS:
        n = int(torch.randint(1, 2 * mean, (1,), generator=generator))
        lengths.append(min(n, TOKENS - sum(lengths)))
    return lengths


def useful_pairs(variant, n):
    """(query, key) pairs of all the sequences, a head."""
    if variant == "gqa":
        return TOKENS * n / 2
    if variant == "window":
        w = min(WINDOW, n)
        return TOKENS // n * (w * n - w * (w - 1) / 2)
    return sum(length**2 for length in packed_lengths(n))


def packed_call(provider, mean, dtype):
    """Packed sequences: our call or SDPA's on a nested tensor, and q, k, v."""
    lengths = packed_lengths(mean)
    shape = (TOKENS, VARIANT_HEADS, VARIANT_HEAD_DIM)
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=dtype) for _ in "qkv")
    offsets = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    starts, longest = offsets.to(torch.int32), max(lengths)
    extent = dict(min_seqlen=min(lengths), max_seqlen=longest)
    nested = lambda t: torch.nested.nested_tensor_from_jagged(t, offsets, **extent)

    def call(q, k, v):
        if provider == "triton":
            return varlen_attention(q, k, v, starts, starts, longest, longest)
        heads = [nested(t).transpose(1, 2) for t in (q, k, v)]  # (B, H, j, D)
        return F.scaled_dot_product_attention(*heads).transpose(1, 2).values()

    return call, (q, k, v)


def variant_call(variant, provider, n, dtype):
    """The call of ``provider`` on the variant's q, k, v, and those."""
    if variant == "varlen":
        return packed_call(provider, n, dtype)
    heads = VARIANT_HEADS // 4 if variant == "gqa" else VARIANT_HEADS
    make = lambda heads: torch.randn(
        TOKENS // n, heads, n, VARIANT_HEAD_DIM, device=DEVICE, dtype=dtype
    )
    q, k, v = make(VARIANT_HEADS), make(heads), make(heads)
    window = WINDOW if variant == "window" else None
    if variant == "window":  # SDPA's: the window as a boolean mask
        columns = torch.arange(n, device=DEVICE)
        rows = columns[:, None]
        mask = (columns <= rows) & (columns > rows - WINDOW)
    backend = BACKENDS.get(provider) if tutorial.ON_GPU else None

    def call(q, k, v):
        if provider == "triton":
            return attention(q, k, v, causal=True, window=window)
        if variant == "gqa":
            return check_attention.sdpa(backend, enable_gqa=True)(q, k, v, True)
        return F.scaled_dot_product_attention(q, k, v, mask)

    return call, (q, k, v)


def make_variant_call(variant, provider, n, dtype, backward):
    function, inputs = variant_call(variant, provider, n, dtype)
    if not backward:
        return lambda: function(*inputs)
    inputs = [t.requires_grad_() for t in inputs]
    out = function(*inputs)  # the backward alone, of this one graph, each call
    grad_out = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)


VARIANTS = {  # peers, sequence lengths (varlen: the mean), the headline's, the smoke's
    "gqa": (["torch", "torch (flash)"], SEQUENCES, 4096, 16),
    "window": (["torch"], SEQUENCES[2:], 8192, 16),
    "varlen": (["torch"], [128, 256, 512, 1024, 2048, 4096], 1024, 8),
}


def variant_benchmark(variant, backward):
    peers, xs, headline, smoke = VARIANTS[variant]
    direction = "backward" if backward else "forward"
    flops = 4 * VARIANT_HEADS * VARIANT_HEAD_DIM * (2.5 if backward else 1)
    return bench.Benchmark(
        name=f"attention-{variant}-{direction}-d128",
        x_name="mean sequence length, 16,384 tokens"
        if variant == "varlen"
        else "N (sequence), 16,384 tokens",
        x_values=xs,
        providers=["triton", *peers],
        unit="TFLOP/s",
        dtypes=(torch.bfloat16,),
        make=lambda p, n, dtype: make_variant_call(variant, p, n, dtype, backward),
        work=lambda n, dtype: flops * useful_pairs(variant, n),
        smoke_x=smoke,
        headline_x=headline,
        uncapturable=("triton", "torch") if variant == "varlen" else (),
    )


for variant, backward in itertools.product(VARIANTS, (False, True)):
    bench.run(variant_benchmark(variant, backward))

# %%
# What we learned
# ---------------
# * Fused attention is a matmul with a softmax in its loop: O(N D) bytes for O(N² D) FLOPs,
#   and the exponentials compete with the tensor cores for time.
# * The online softmax needs one pass over the keys; L lets the backward rebuild P.
# * Masks cost only where the mask is; descriptors handle the ragged edges for free.
# * A backward split by what each program owns needs no atomics and repeats bit for bit.
# * Grouped heads, windows and packed sequences are loop bounds and offsets in the same
#   kernels: a window skips the blocks outside its band, a kv head's key program sums its
#   group, and packed sequences need masked stores where the descriptor's edge is not
#   theirs.
#
# The sweep behind the launch rules, and the variants that lost (warp specialization, lazy
# rescaling, descriptors made in the kernel), are in ``lab/attention_sweep.py`` and
# ``lab/NOTES.md``.
#
# Exercises
# ---------
# 1. Add dQ to the key-block kernel with ``tl.atomic_add`` into an fp32 buffer, drop the
#    query kernel, and time it: how much faster, and how far apart are two runs' dQ?
# 2. Grouped heads in the forward: let one program own a block of queries of all g query
#    heads of a group, K and V loaded once for the g of them. How large a BLOCK_M still
#    fits the registers, and does it beat the L2's reuse at g = 4?
# 3. Add an ALiBi bias, a slope per head times (j - i), to the scores: where does it go so
#    that the unmasked blocks stay cheap?
