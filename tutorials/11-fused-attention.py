r"""
Fused attention
===============

We write attention, softmax(Q Kᵀ · scale) V, as kernels that never hold the N x N scores: a
forward that streams keys and values past a block of queries, and a backward that rebuilds
what it needs from the forward's log-sum-exp. What you will learn:

* why naive attention is bound by memory and fused attention by the tensor cores;
* chapter 02's online softmax in a tiled kernel, the scale folded into exp2;
* which blocks a causal mask touches: skip some, unmask most, mask the rest;
* tiles loaded through TMA tensor descriptors, which also pad ragged edges with zeros;
* FlashAttention-2's split of the backward, without atomics: the same bits on every run.

Prerequisites: chapter 02 (the online softmax), chapter 05 (autograd), chapter 07 (TMA).
"""

# %%
# Setup
# -----

import itertools

from stepkernels import bench, check_attention, tutorial
import torch
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
    scores_gib, qkvo_mib = (
        2 * n * n * 2 / 2**30,
        4 * n * 128 * 2 / 2**20,
    )  # bf16, D = 128
    print(
        f"N = {n:>6,}: S and P {scores_gib:5.2f} GiB a head; Q, K, V, O {qkvo_mib:.0f} MiB"
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
# * **Tiles through tensor descriptors**: ``tl.make_tensor_descriptor`` describes a head's
#   N x D matrix to the TMA unit (chapter 07), which copies tiles to shared memory while the
#   warps compute, reads past the edges as zeros and drops them on a store: ragged lengths
#   and head dims such as 80 need no masks. It wants the last dimension contiguous and the
#   other strides multiples of 16 bytes.

# @save attention
from dataclasses import dataclass
import functools

from stepkernels._core import (
    FLOAT_DTYPES,
    INTERPRET,
    ON_GPU,
    check_tensor,
    refuse_double_backward,
)
from stepkernels.launch import lean
from stepkernels.matmul import dot_precision
from stepkernels.matmul_hopper import tma_scratch
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2 e)
# The interpreter's tl.dot cannot take bf16 (docs/running.rst): fp32 tiles there.
UPCAST = tl.constexpr(INTERPRET)


@triton.jit
def head_matrix(ptr, program, n_heads, stride_b, stride_h, stride_n, n_rows, head_dim,
                BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """A descriptor of one head's (n_rows, head_dim) matrix, in [BLOCK, HEAD_DIM] tiles."""
    batch, head = program // n_heads, program % n_heads
    start = ptr + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    return tl.make_tensor_descriptor(
        start, [n_rows, head_dim], [stride_n, 1], [BLOCK, HEAD_DIM]
    )


@triton.jit
def load_tile(matrix, row):
    tile = matrix.load([row, 0])
    return tile.to(tl.float32) if UPCAST else tile


@triton.jit
def attend(acc, row_sum, row_max, q, keys, values, offs_m, lo, hi, n_kv, scale_log2,
           BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
           PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):  # fmt: skip
    """The online softmax over keys [lo, hi). MASK: drop keys past n_kv and, if CAUSAL,
    keys j > i, in the blocks that hold some."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = load_tile(keys, start_n)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASK:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            keep = offs_n[None, :] < n_kv
            if CAUSAL:
                keep &= offs_n[None, :] <= offs_m[:, None]
            scores = tl.where(keep, scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * scale_log2)
        p = tl.exp2(scores * scale_log2 - new_max[:, None])  # one FMA a score
        alpha = tl.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = load_tile(values, start_n)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@lean
@triton.jit
def attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, n_heads, n_q, n_kv, head_dim, scale_log2,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    if CAUSAL:  # the longest rows first
        block = tl.num_programs(0) - 1 - block
    start_m, bh = block * BLOCK_M, tl.program_id(1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    queries = head_matrix(q_ptr, bh, n_heads, stride_qb, stride_qh, stride_qn, n_q,
                          head_dim, BLOCK_M, HEAD_DIM)  # fmt: skip
    keys = head_matrix(k_ptr, bh, n_heads, stride_kb, stride_kh, stride_kn, n_kv,
                       head_dim, BLOCK_N, HEAD_DIM)  # fmt: skip
    values = head_matrix(v_ptr, bh, n_heads, stride_vb, stride_vh, stride_vn, n_kv,
                         head_dim, BLOCK_N, HEAD_DIM)  # fmt: skip
    q = load_tile(queries, start_m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    # Whole key blocks no row of ours masks, then the diagonal and the ragged end, masked.
    whole = n_kv // BLOCK_N * BLOCK_N
    end = tl.minimum(start_m // BLOCK_N * BLOCK_N, whole) if CAUSAL else whole
    hi = tl.minimum(start_m + BLOCK_M, n_kv) if CAUSAL else n_kv
    acc, row_sum, row_max = attend(acc, row_sum, row_max, q, keys, values, offs_m, 0, end,
                                   n_kv, scale_log2, BLOCK_N, False, CAUSAL, PRECISION,
                                   WARP_SPECIALIZE)  # fmt: skip
    acc, row_sum, row_max = attend(acc, row_sum, row_max, q, keys, values, offs_m, end, hi,
                                   n_kv, scale_log2, BLOCK_N, True, CAUSAL, PRECISION,
                                   WARP_SPECIALIZE)  # fmt: skip
    outputs = head_matrix(o_ptr, bh, n_heads, stride_ob, stride_oh, stride_on, n_q,
                          head_dim, BLOCK_M, HEAD_DIM)  # fmt: skip
    outputs.store([start_m, 0], (acc / row_sum[:, None]).to(o_ptr.dtype.element_ty))
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
# δ, the softmax backward's row term, comes first from a small kernel. dK and dV sum over
# queries, dQ over keys: no one tiling owns all three. A program per *key* block keeps K, V
# and the dK, dV accumulators on chip while it walks the query blocks; a program per *query*
# block does the same for dQ. Both rebuild P: seven products where five would do. Adding dQ
# from the key programs with atomics saves two, but the result then depends on the order the
# atomics land in; we keep the bits repeatable. Causal loops split as in the forward.


# @save attention
@lean
@triton.jit
def output_dot_grad_kernel(o_ptr, do_ptr, delta_ptr, n_heads, n_q, head_dim,
                           stride_ob, stride_oh, stride_on, stride_gb, stride_gh, stride_gn,
                           BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """δ_i = Σ_d dO_id O_id for a block of rows."""
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    outputs = head_matrix(o_ptr, bh, n_heads, stride_ob, stride_oh, stride_on, n_q,
                          head_dim, BLOCK_M, HEAD_DIM)  # fmt: skip
    grads = head_matrix(do_ptr, bh, n_heads, stride_gb, stride_gh, stride_gn, n_q,
                        head_dim, BLOCK_M, HEAD_DIM)  # fmt: skip
    o = load_tile(outputs, start_m).to(tl.float32)
    do = load_tile(grads, start_m).to(tl.float32)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    delta_ptrs = delta_ptr + bh.to(tl.int64) * n_q + offs_m
    tl.store(delta_ptrs, tl.sum(o * do, axis=1), offs_m < n_q)


@triton.jit
def key_block_grads(dk, dv, k, v, queries, grads, lse_row, delta_row, offs_n, lo, hi, n_q,
                    scale_log2, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                    PRECISION: tl.constexpr):  # fmt: skip
    """dK and dV of a key block over the query blocks [lo, hi), transposed: P is [keys,
    queries]. Rows past n_q read as zeros (q, dO, L, δ) and add nothing. MASK: i < j."""
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(queries, start_m)
        do = load_tile(grads, start_m)
        lse = tl.load(lse_row + offs_m, offs_m < n_q, 0.0)
        delta = tl.load(delta_row + offs_m, offs_m < n_q, 0.0)
        scores = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        p = tl.exp2(scores * scale_log2 - lse[None, :])
        if MASK:
            p = tl.where(offs_m[None, :] >= offs_n[:, None], p, 0.0)
        dv = tl.dot(p.to(do.dtype), do, dv, input_precision=PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds = p * (dp - delta[None, :])
        dk = tl.dot(ds.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@lean
@triton.jit
def attention_key_grads_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, n_heads, n_q, n_kv,
    head_dim, scale_log2, sm_scale, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
    stride_kn, stride_vb, stride_vh, stride_vn, stride_gb, stride_gh, stride_gn,
    stride_rb, stride_rh, stride_rn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    start_n, bh = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    keys = head_matrix(k_ptr, bh, n_heads, stride_kb, stride_kh, stride_kn, n_kv,
                       head_dim, BLOCK_N, HEAD_DIM)  # fmt: skip
    values = head_matrix(v_ptr, bh, n_heads, stride_vb, stride_vh, stride_vn, n_kv,
                         head_dim, BLOCK_N, HEAD_DIM)  # fmt: skip
    queries = head_matrix(q_ptr, bh, n_heads, stride_qb, stride_qh, stride_qn, n_q,
                          head_dim, BLOCK_M, HEAD_DIM)  # fmt: skip
    grads = head_matrix(do_ptr, bh, n_heads, stride_gb, stride_gh, stride_gn, n_q,
                        head_dim, BLOCK_M, HEAD_DIM)  # fmt: skip
    k, v = load_tile(keys, start_n), load_tile(values, start_n)
    lse_row = lse_ptr + bh.to(tl.int64) * n_q
    delta_row = delta_ptr + bh.to(tl.int64) * n_q
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = 0
    if CAUSAL:  # queries i >= j only; those on the diagonal masked
        lo = start_n // BLOCK_M * BLOCK_M
        diagonal_end = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, n_q)
        dk, dv = key_block_grads(dk, dv, k, v, queries, grads, lse_row, delta_row, offs_n,
                                 lo, diagonal_end, n_q, scale_log2, BLOCK_M, True,
                                 PRECISION)  # fmt: skip
        lo = tl.maximum(diagonal_end, lo)
    dk, dv = key_block_grads(dk, dv, k, v, queries, grads, lse_row, delta_row, offs_n, lo,
                             n_q, n_q, scale_log2, BLOCK_M, False, PRECISION)  # fmt: skip
    key_grads = head_matrix(dk_ptr, bh, n_heads, stride_rb, stride_rh, stride_rn, n_kv,
                            head_dim, BLOCK_N, HEAD_DIM)  # fmt: skip
    value_grads = head_matrix(dv_ptr, bh, n_heads, stride_rb, stride_rh, stride_rn, n_kv,
                              head_dim, BLOCK_N, HEAD_DIM)  # fmt: skip
    key_grads.store([start_n, 0], (dk * sm_scale).to(dk_ptr.dtype.element_ty))
    value_grads.store([start_n, 0], dv.to(dv_ptr.dtype.element_ty))


@triton.jit
def query_block_grad(dq, q, do, lse, delta, keys, values, offs_m, lo, hi, scale_log2,
                     BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                     PRECISION: tl.constexpr):  # fmt: skip
    """dQ of a query block over the key blocks [lo, hi). Keys past n_kv read as zeros and
    add nothing (dQ sums dS K). MASK: j > i."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        k, v = load_tile(keys, start_n), load_tile(values, start_n)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.exp2(scores * scale_log2 - lse[:, None])
        if MASK:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@lean
@triton.jit
def attention_query_grad_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, n_heads, n_q, n_kv, head_dim,
    scale_log2, sm_scale, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_gb, stride_gh, stride_gn, stride_rb, stride_rh,
    stride_rn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    if CAUSAL:  # the longest rows first
        block = tl.num_programs(0) - 1 - block
    start_m, bh = block * BLOCK_M, tl.program_id(1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    queries = head_matrix(q_ptr, bh, n_heads, stride_qb, stride_qh, stride_qn, n_q,
                          head_dim, BLOCK_M, HEAD_DIM)  # fmt: skip
    grads = head_matrix(do_ptr, bh, n_heads, stride_gb, stride_gh, stride_gn, n_q,
                        head_dim, BLOCK_M, HEAD_DIM)  # fmt: skip
    keys = head_matrix(k_ptr, bh, n_heads, stride_kb, stride_kh, stride_kn, n_kv,
                       head_dim, BLOCK_N, HEAD_DIM)  # fmt: skip
    values = head_matrix(v_ptr, bh, n_heads, stride_vb, stride_vh, stride_vn, n_kv,
                         head_dim, BLOCK_N, HEAD_DIM)  # fmt: skip
    q, do = load_tile(queries, start_m), load_tile(grads, start_m)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * n_q + offs_m, offs_m < n_q, 0.0)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * n_q + offs_m, offs_m < n_q, 0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = tl.minimum(start_m // BLOCK_N * BLOCK_N, n_kv) if CAUSAL else n_kv
    dq = query_block_grad(dq, q, do, lse, delta, keys, values, offs_m, 0, end, scale_log2,
                          BLOCK_N, False, PRECISION)  # fmt: skip
    if CAUSAL:  # the diagonal blocks
        hi = tl.minimum(start_m + BLOCK_M, n_kv)
        dq = query_block_grad(dq, q, do, lse, delta, keys, values, offs_m, end, hi,
                              scale_log2, BLOCK_N, True, PRECISION)  # fmt: skip
    query_grads = head_matrix(dq_ptr, bh, n_heads, stride_rb, stride_rh, stride_rn, n_q,
                              head_dim, BLOCK_M, HEAD_DIM)  # fmt: skip
    query_grads.store([start_m, 0], (dq * sm_scale).to(dq_ptr.dtype.element_ty))


# %%
# Launches, layouts and the autograd function
# -------------------------------------------
# Launch rules come from sweeps on the H100 (``tools/experiments/attention_sweep.py``, its log
# beside the results): blocks of queries x keys, warps and pipeline stages for each kernel,
# by head dim. Tensors a descriptor cannot describe (a last dimension that is not contiguous,
# a stride that is not a multiple of 16 bytes, as with D = 20 in fp16) are copied once into
# a layout it can: contiguous, the head dim padded to 16 bytes. A (B, N, H, D) tensor viewed
# as (B, H, N, D) is taken as it is. Under the interpreter the blocks are 16 x 16.

# @save attention
MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class Launch:
    block_m: int  # queries per block
    block_n: int  # keys per block
    num_warps: int
    num_stages: int
    warp_specialize: bool = False  # producer and consumer warps: forward only


@functools.cache
def default_launches(head_dim: int, element_size: int, causal: bool):
    """(forward, key gradients, query gradient) for a head dim padded to a power of two."""
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


def empty_heads(shape, dtype, device) -> torch.Tensor:
    """A new (B, H, N, D) tensor whose rows start on 16-byte boundaries."""
    step = 16 // torch.empty((), dtype=dtype).element_size()
    padded = -(-shape[3] // step) * step
    return torch.empty(*shape[:3], padded, dtype=dtype, device=device)[..., : shape[3]]


def ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it that a descriptor can describe."""
    if descriptor_ready(t):
        return t
    copy = empty_heads(t.shape, t.dtype, t.device)
    return copy.copy_(t)


def strides3(t):  # batch, head, sequence: the last is 1
    return t.stride()[:3]


def padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def attention_forward(q, k, v, causal, sm_scale, launch=None):
    """O and the base-2 log-sum-exp of each row, for descriptor-ready q, k, v."""
    batch, heads, n_q, head_dim = q.shape
    o = empty_heads(q.shape, q.dtype, q.device)
    lse = torch.empty(batch * heads, n_q, device=q.device, dtype=torch.float32)
    padded = padded_head_dim(head_dim)
    launch = launch or default_launches(padded, q.element_size(), causal)[0]
    triton.set_allocator(tma_scratch)  # for descriptors made in kernels (chapter 07)
    grid = (triton.cdiv(n_q, launch.block_m), batch * heads)
    attention_forward_kernel[grid](
        q, k, v, o, lse, heads, n_q, k.shape[2], head_dim, sm_scale * LOG2E, *strides3(q),
        *strides3(k), *strides3(v), *strides3(o), BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n, HEAD_DIM=padded, CAUSAL=causal,
        PRECISION=dot_precision(q.dtype), WARP_SPECIALIZE=launch.warp_specialize,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return o, lse


def attention_backward(q, k, v, o, lse, do, causal, sm_scale, launches=None):
    """dQ, dK, dV for descriptor-ready tensors; ``launches``: (key, query) gradients."""
    batch, heads, n_q, head_dim = q.shape
    n_kv, padded = k.shape[2], padded_head_dim(head_dim)
    _, key_launch, query_launch = default_launches(padded, q.element_size(), causal)
    key_launch, query_launch = launches or (key_launch, query_launch)
    triton.set_allocator(tma_scratch)
    delta = torch.empty_like(lse)
    output_dot_grad_kernel[(triton.cdiv(n_q, 64), batch * heads)](
        o, do, delta, heads, n_q, head_dim, *strides3(o), *strides3(do), BLOCK_M=64,
        HEAD_DIM=padded,
    )  # fmt: skip
    dq = empty_heads(q.shape, q.dtype, q.device)
    dk = empty_heads(k.shape, k.dtype, k.device)
    dv = empty_heads(v.shape, v.dtype, v.device)
    common = (heads, n_q, n_kv, head_dim, sm_scale * LOG2E, sm_scale, *strides3(q),
              *strides3(k), *strides3(v), *strides3(do))  # fmt: skip
    options = dict(HEAD_DIM=padded, CAUSAL=causal, PRECISION=dot_precision(q.dtype))
    attention_key_grads_kernel[(triton.cdiv(n_kv, key_launch.block_n), batch * heads)](
        q, k, v, do, lse, delta, dk, dv, *common, *strides3(dk),
        BLOCK_M=key_launch.block_m, BLOCK_N=key_launch.block_n, **options,
        num_warps=key_launch.num_warps, num_stages=key_launch.num_stages,
    )  # fmt: skip
    attention_query_grad_kernel[(triton.cdiv(n_q, query_launch.block_m), batch * heads)](
        q, k, v, do, lse, delta, dq, *common, *strides3(dq),
        BLOCK_M=query_launch.block_m, BLOCK_N=query_launch.block_n, **options,
        num_warps=query_launch.num_warps, num_stages=query_launch.num_stages,
    )  # fmt: skip
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


def check_attention_inputs(q, k, v, sm_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, FLOAT_DTYPES)
        if t.dim() != 4:
            shape = tuple(t.shape)  # a (B, N, H, D) tensor needs .transpose(1, 2)
            raise ValueError(
                f"{name} must be (batch, heads, sequence, head_dim): {shape}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            "k and v must have one shape, and q the same batch, heads and head_dim (grouped "
            f"heads and other value head dims are not supported): q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not 0 < q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be 1 to {MAX_HEAD_DIM}, got {q.shape[3]}")
    if k.shape[2] == 0 and q.shape[2] > 0:
        raise ValueError(
            "there are queries but no keys: give attention at least one key"
        )
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")


def attention(q, k, v, causal=False, sm_scale=None):
    """``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
    scale=sm_scale)`` for (batch, heads, sequence, head_dim) tensors in fp16, bf16 or fp32
    (tf32 products unless ``torch.set_float32_matmul_precision("highest")``), with autograd.
    ``causal``: query i sees keys j <= i, as SDPA's ``is_causal``. Head dims up to 128."""
    check_attention_inputs(q, k, v, sm_scale)
    scale = q.shape[3] ** -0.5 if sm_scale is None else float(sm_scale)
    if q.numel() == 0:  # nothing to attend: SDPA's result, an empty or zero tensor
        return q.new_zeros(q.shape) + 0 * (q.sum() + k.sum() + v.sum())
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return AttentionFunction.apply(q, k, v, bool(causal), scale)
    return attention_forward(ready(q), ready(k), ready(v), bool(causal), scale)[0]


# %%
# Correctness
# -----------
# ``check_attention.check`` compares the output and the three gradients with SDPA computed in
# fp64, within a rounding of the dtype: sequence lengths that are not multiples of a block
# (queries and keys of different lengths too), a head dim of 80 (padded to 128 in the
# kernels), causal and not, and the layout a fused projection gives, (B, N, H, D) viewed as
# (B, H, N, D). Then the errors that say what to do.

sizes = tutorial.choose(
    gpu=[(130, 130), (1000, 1000), (77, 300)], cpu=[(17, 17), (33, 50)]
)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
for dtype, (n_q, n_kv), head_dim, causal in itertools.product(
    DTYPES, sizes, (64, 80), (False, True)
):
    q, k, v = check_attention.inputs(2, 3, n_q, n_kv, head_dim, dtype, DEVICE)
    check_attention.check(attention, q, k, v, causal=causal)
q, k, v = check_attention.inputs(2, 3, 40, 40, 128, torch.bfloat16, DEVICE, "BNHD")
check_attention.check(attention, q, k, v, causal=True)
print(f"attention matches SDPA: {len(sizes)} sizes, head dims 64, 80, 128, 3 dtypes")
zeros = lambda *shape: torch.zeros(*shape, device=DEVICE, dtype=torch.float16)
tutorial.show_refusals("attention()", {
    "3-D q": lambda: attention(zeros(2, 8, 16), zeros(2, 8, 16), zeros(2, 8, 16)),
    "head dims differ": lambda: attention(zeros(1, 2, 8, 64), *[zeros(1, 2, 8, 32)] * 2),
    "head dim 256": lambda: attention(*[zeros(1, 2, 8, 256)] * 3),
    "dtypes differ": lambda: attention(zeros(1, 2, 8, 64), *[zeros(1, 2, 8, 64).float()] * 2),
    "no keys": lambda: attention(zeros(1, 2, 8, 64), *[zeros(1, 2, 0, 64)] * 2),
})  # fmt: skip

# %%
# Benchmarks
# ----------
# 16,384 tokens split into batches of sequences of N = 512 to 16,384, with 2,048 channels
# (16 heads of 128 or 32 of 64), causal and not, bf16 and fp16; the forward, and the backward
# alone (``torch.autograd.grad`` of a kept graph). Peers: SDPA as PyTorch picks (``torch``,
# cuDNN's kernel on the H100), SDPA held to FlashAttention-2 (``torch (flash)``) and to cuDNN,
# and ``torch.compile`` of the naive attention. TFLOP/s of the FLOPs above (causal: half),
# GPU time of CUDA-graph replays; the dashed line is cuBLAS's fp16 product at 4096³.

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

TOKENS = tutorial.choose(gpu=16384, cpu=64)
SEQUENCES = [512, 1024, 2048, 4096, 8192, 16384]
BACKENDS = {"torch (flash)": SDPBackend.FLASH_ATTENTION,
            "torch (cudnn)": SDPBackend.CUDNN_ATTENTION}  # fmt: skip
PROVIDERS = ["triton", "torch", *BACKENDS, "torch.compile"]


def naive_attention(q, k, v, causal):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def sdpa(backend):
    def call(q, k, v, causal):
        if backend is None or not tutorial.ON_GPU:  # SDPA's own choice; the CPU's
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return call


def make_attention_call(provider, n, dtype, head_dim, causal, backward):
    shape = (TOKENS // n, 2048 // head_dim, n, head_dim)
    q, k, v, grad_out = (
        torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(4)
    )
    function = (
        sdpa(BACKENDS.get(provider)) if provider.startswith("torch") else attention
    )
    if provider == "torch.compile":
        function = bench.compile_static(naive_attention)
    if not backward:
        return lambda: function(q, k, v, causal)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = function(
        *inputs, causal
    )  # the backward alone, of this graph, again and again
    return lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)


def attention_benchmark(head_dim, causal, backward):
    direction = "backward" if backward else "forward"
    name = f"attention-{direction}-d{head_dim}" + ("-causal" if causal else "")
    per_token = 4 * 2048 / (2 if causal else 1) * (2.5 if backward else 1)  # x N
    return bench.Benchmark(
        name=name, x_name=f"N (sequence), {TOKENS:,} tokens", x_values=SEQUENCES,
        providers=PROVIDERS, unit="TFLOP/s", dtypes=(torch.bfloat16, torch.float16),
        make=lambda p, n, dtype: make_attention_call(p, n, dtype, head_dim, causal, backward),
        work=lambda n, dtype: per_token * TOKENS * n, smoke_x=32, headline_x=4096,
    )  # fmt: skip


attention_results = {}
for head_dim, causal, backward in itertools.product(
    (128, 64), (False, True), (False, True)
):
    benchmark = attention_benchmark(head_dim, causal, backward)
    attention_results[benchmark.name] = bench.run(benchmark)

# %%
# Where we stand, against every peer and against FlashAttention-2 and ``torch.compile``:

for name, results in attention_results.items():
    if results:
        floor = results.standing("triton", peers=["torch (flash)", "torch.compile"])
        lines = results.standing("triton", "torch (cudnn)")
        print(f"{name}, {results.how}:\n  " + "\n  ".join(lines))
        print("  against FlashAttention-2 and torch.compile: " + "; ".join(floor))

# %%
# What we learned
# ---------------
# * Fused attention moves O(N D) bytes for O(N² D) FLOPs: it is a matmul kernel with a
#   softmax in its loop, and the softmax's exponentials and rescaling compete with the
#   tensor cores for time.
# * The online softmax makes one pass over the keys enough; keeping L lets the backward
#   rebuild P instead of storing it.
# * Masks cost only where the mask is: split each loop into whole blocks and the edge.
# * Tensor descriptors give the loads to the TMA unit and handle ragged edges for free.
# * A backward split by what each program owns needs no atomics and repeats bit for bit.
#
# Exercises
# ---------
# 1. Add dQ to the key-block kernel with ``tl.atomic_add`` into an fp32 buffer, drop the
#    query kernel, and time it: how much faster, and how far apart are two runs' dQ?
# 2. Grouped-query attention: let k and v have fewer heads than q (each serves
#    ``heads // kv_heads`` query heads). What changes in the forward, and in dK, dV?
# 3. Add an ALiBi bias, a slope per head times (j - i), to the scores: where does it go so
#    that the unmasked blocks stay cheap?
