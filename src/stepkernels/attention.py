"""attention: the code of chapter 11, Fused attention."""

# Generated from tutorials/11-fused-attention.py by tools/export.py: edit the chapter, then `make
# export`.

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
