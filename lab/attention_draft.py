"""Issue 17's fused attention as first drafted, before chapter 11: forward and backward kernels.

    python lab/attention_draft.py     # without a GPU: checks against SDPA in fp64

Forward: chapter 02's online softmax over key blocks, exp2 with the scale folded in, whole
blocks unmasked and only the diagonal (causal) and the key tail masked, tiles loaded through
pointers. (Its variant with descriptors made in the kernel, run with --tma at commit 998fca6,
became chapter 11's kernels.) Backward: FlashAttention-2's split, deterministic (no atomics):
delta = rowsum(dO * O), one kernel per key block for dK and dV looping over query blocks, one
per query block for dQ looping over key blocks. Any lengths (queries and keys apart, causal
as SDPA's ``is_causal``: j <= i), head dims up to 128 padded to a power of two, strided
(B, H, N, D) views. ``attention_sweep.py`` times the pointer-loading forward beside chapter
11's kernels; the log is lab/attention_sweep.log.
"""

from dataclasses import dataclass

from stepkernels.runtime.core import ON_GPU
from stepkernels.runtime.launch import lean
from stepkernels.runtime.tiles import dot_precision
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2 e): the scale folds into one multiply


@triton.jit
def tile(ptr, rows, cols, row_stride, col_stride, n_rows, n_cols):
    """The [rows, cols] tile of a matrix, zeros outside it."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :] * col_stride, mask, 0.0)


@triton.jit
def attend(acc, row_sum, row_max, q, k_base, v_base, offs_m, lo, hi, n_kv, head_dim,
           stride_kn, stride_kd, stride_vn, stride_vd, scale_log2, BLOCK_N: tl.constexpr,
           HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
           PRECISION: tl.constexpr):  # fmt: skip
    """Online softmax over the keys [lo, hi): chapter 02's running max and sum, with
    the output's accumulator rescaled alongside. MASK: drop keys past n_kv and, if CAUSAL,
    above the diagonal (j > i), for the blocks that hold some."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_t = tile(k_base, offs_d, offs_n, stride_kd, stride_kn, head_dim, n_kv)
        scores = tl.dot(q, k_t, input_precision=PRECISION) * scale_log2
        if MASK:
            keep = offs_n[None, :] < n_kv
            if CAUSAL:
                keep &= offs_n[None, :] <= offs_m[:, None]
            scores = tl.where(keep, scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        p = tl.exp2(scores - new_max[:, None])
        alpha = tl.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tile(v_base, offs_n, offs_d, stride_vn, stride_vd, n_kv, head_dim)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@lean
@triton.jit
def attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, n_heads, n_q, n_kv, head_dim, scale_log2,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    batch, head = tl.program_id(1) // n_heads, tl.program_id(1) % n_heads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vh
    q = tile(q_base, offs_m, offs_d, stride_qn, stride_qd, n_q, head_dim)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    # Whole key blocks that no row of this block masks, then the rest with masks.
    whole = n_kv // BLOCK_N * BLOCK_N
    end = tl.minimum(start_m, whole) if CAUSAL else whole
    hi = tl.minimum(start_m + BLOCK_M, n_kv) if CAUSAL else n_kv
    acc, row_sum, row_max = attend(acc, row_sum, row_max, q, k_base, v_base, offs_m, 0, end,
                                   n_kv, head_dim, stride_kn, stride_kd, stride_vn, stride_vd,
                                   scale_log2, BLOCK_N, HEAD_DIM, False, CAUSAL, PRECISION)  # fmt: skip
    acc, row_sum, row_max = attend(acc, row_sum, row_max, q, k_base, v_base, offs_m, end, hi,
                                   n_kv, head_dim, stride_kn, stride_kd, stride_vn, stride_vd,
                                   scale_log2, BLOCK_N, HEAD_DIM, True, CAUSAL, PRECISION)  # fmt: skip
    out = acc / row_sum[:, None]
    o_base = o_ptr + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    mask = (offs_m < n_q)[:, None] & (offs_d < head_dim)[None, :]
    o_ptrs = o_base + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask)
    lse_row = lse_ptr + tl.program_id(1).to(tl.int64) * n_q + offs_m
    tl.store(lse_row, row_max + tl.log2(row_sum), offs_m < n_q)  # base 2, of scaled scores


@lean
@triton.jit
def output_dot_grad_kernel(o_ptr, do_ptr, delta_ptr, n_heads, n_q, head_dim,
                           stride_ob, stride_oh, stride_on, stride_od, stride_gb, stride_gh,
                           stride_gn, stride_gd, BLOCK_M: tl.constexpr,
                           HEAD_DIM: tl.constexpr):  # fmt: skip
    """delta_i = sum_d dO_id O_id, the softmax backward's row term."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    batch, head = tl.program_id(1) // n_heads, tl.program_id(1) % n_heads
    o = tile(o_ptr + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh,
             offs_m, offs_d, stride_on, stride_od, n_q, head_dim)  # fmt: skip
    do = tile(do_ptr + batch.to(tl.int64) * stride_gb + head.to(tl.int64) * stride_gh,
              offs_m, offs_d, stride_gn, stride_gd, n_q, head_dim)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + tl.program_id(1).to(tl.int64) * n_q + offs_m, delta, offs_m < n_q)


@triton.jit
def key_block_grads(dk, dv, k, v, q_base, do_base, lse_row, delta_row, offs_n, lo, hi, n_q,
                    head_dim, stride_qn, stride_qd, stride_gn, stride_gd, scale_log2,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr,
                    PRECISION: tl.constexpr):  # fmt: skip
    """dK and dV of one key block, over the query blocks [lo, hi). Rows past n_q load as
    zeros (q, dO, lse, delta) and so add nothing. MASK: drop i < j."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_t = tile(q_base, offs_d, offs_m, stride_qd, stride_qn, head_dim, n_q)
        do = tile(do_base, offs_m, offs_d, stride_gn, stride_gd, n_q, head_dim)
        lse = tl.load(lse_row + offs_m, offs_m < n_q, 0.0)
        delta = tl.load(delta_row + offs_m, offs_m < n_q, 0.0)
        p_t = tl.exp2(tl.dot(k, q_t, input_precision=PRECISION) * scale_log2 - lse[None, :])
        if MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk, input_precision=PRECISION)
    return dk, dv


@lean
@triton.jit
def attention_key_grads_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, n_heads, n_q, n_kv,
    head_dim, scale_log2, sm_scale, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb,
    stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_gb,
    stride_gh, stride_gn, stride_gd, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    start_n = tl.program_id(0) * BLOCK_N
    batch, head = tl.program_id(1) // n_heads, tl.program_id(1) % n_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    bh = tl.program_id(1).to(tl.int64)
    k = tile(k_ptr + batch.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh,
             offs_n, offs_d, stride_kn, stride_kd, n_kv, head_dim)  # fmt: skip
    v = tile(v_ptr + batch.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vh,
             offs_n, offs_d, stride_vn, stride_vd, n_kv, head_dim)  # fmt: skip
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    do_base = do_ptr + batch.to(tl.int64) * stride_gb + head.to(tl.int64) * stride_gh
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo, diagonal_end = 0, 0
    if CAUSAL:  # queries i >= j only; the blocks on the diagonal need the mask
        lo = start_n // BLOCK_M * BLOCK_M
        diagonal_end = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, n_q)
        dk, dv = key_block_grads(dk, dv, k, v, q_base, do_base, lse_ptr + bh * n_q,
                                 delta_ptr + bh * n_q, offs_n, lo, diagonal_end, n_q,
                                 head_dim, stride_qn, stride_qd, stride_gn, stride_gd,
                                 scale_log2, BLOCK_M, HEAD_DIM, True, PRECISION)  # fmt: skip
        lo = tl.maximum(diagonal_end, lo)
    dk, dv = key_block_grads(dk, dv, k, v, q_base, do_base, lse_ptr + bh * n_q,
                             delta_ptr + bh * n_q, offs_n, lo, n_q, n_q, head_dim,
                             stride_qn, stride_qd, stride_gn, stride_gd, scale_log2,
                             BLOCK_M, HEAD_DIM, False, PRECISION)  # fmt: skip
    mask = (offs_n < n_kv)[:, None] & (offs_d < head_dim)[None, :]
    rows = bh * n_kv * head_dim + offs_n[:, None] * head_dim + offs_d[None, :]  # contiguous
    tl.store(dk_ptr + rows, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask)
    tl.store(dv_ptr + rows, dv.to(dv_ptr.dtype.element_ty), mask)


@triton.jit
def query_block_grad(dq, q, do, lse, delta, k_base, v_base, offs_m, lo, hi, n_kv, head_dim,
                     stride_kn, stride_kd, stride_vn, stride_vd, scale_log2,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr,
                     PRECISION: tl.constexpr):  # fmt: skip
    """dQ of one query block over the key blocks [lo, hi). Keys past n_kv load as zeros and
    add nothing (dQ sums dS K). MASK: drop j > i."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_t = tile(k_base, offs_d, offs_n, stride_kd, stride_kn, head_dim, n_kv)
        v_t = tile(v_base, offs_d, offs_n, stride_vd, stride_vn, head_dim, n_kv)
        p = tl.exp2(tl.dot(q, k_t, input_precision=PRECISION) * scale_log2 - lse[:, None])
        if MASK:
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        ds = p * (tl.dot(do, v_t, input_precision=PRECISION) - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq, input_precision=PRECISION)
    return dq


@lean
@triton.jit
def attention_query_grad_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, n_heads, n_q, n_kv, head_dim,
    scale_log2, sm_scale, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh,
    stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_gb, stride_gh,
    stride_gn, stride_gd, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    batch, head = tl.program_id(1) // n_heads, tl.program_id(1) % n_heads
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tile(q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh,
             offs_m, offs_d, stride_qn, stride_qd, n_q, head_dim)  # fmt: skip
    do = tile(do_ptr + batch.to(tl.int64) * stride_gb + head.to(tl.int64) * stride_gh,
              offs_m, offs_d, stride_gn, stride_gd, n_q, head_dim)  # fmt: skip
    lse = tl.load(lse_ptr + bh * n_q + offs_m, offs_m < n_q, 0.0)
    delta = tl.load(delta_ptr + bh * n_q + offs_m, offs_m < n_q, 0.0)
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = tl.minimum(start_m, n_kv) if CAUSAL else n_kv
    dq = query_block_grad(dq, q, do, lse, delta, k_base, v_base, offs_m, 0, end, n_kv,
                          head_dim, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2,
                          BLOCK_N, HEAD_DIM, False, PRECISION)  # fmt: skip
    if CAUSAL:  # the diagonal blocks
        hi = tl.minimum(start_m + BLOCK_M, n_kv)
        dq = query_block_grad(dq, q, do, lse, delta, k_base, v_base, offs_m, end, hi, n_kv,
                              head_dim, stride_kn, stride_kd, stride_vn, stride_vd,
                              scale_log2, BLOCK_N, HEAD_DIM, True, PRECISION)  # fmt: skip
    mask = (offs_m < n_q)[:, None] & (offs_d < head_dim)[None, :]
    rows = bh * n_q * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]  # contiguous
    tl.store(dq_ptr + rows, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask)


@dataclass(frozen=True)
class Launch:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def launches(head_dim_padded: int, element_size: int):
    """(forward, key gradients, query gradient): blocks of queries x keys, warps, stages."""
    if not ON_GPU:
        return Launch(16, 16, 4, 1), Launch(16, 16, 4, 1), Launch(16, 16, 4, 1)
    if head_dim_padded <= 64:
        return Launch(128, 64, 4, 3), Launch(64, 128, 8, 3), Launch(128, 64, 8, 3)
    return Launch(128, 64, 8, 3), Launch(64, 128, 8, 2), Launch(128, 64, 8, 2)


def attention_forward(q, k, v, causal, sm_scale, launch=None):
    batch, heads, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(batch * heads, n_q, device=q.device, dtype=torch.float32)
    padded = max(16, triton.next_power_of_2(head_dim))
    launch = launch or launches(padded, q.element_size())[0]
    grid = (triton.cdiv(n_q, launch.block_m), batch * heads)
    attention_forward_kernel[grid](
        q, k, v, o, lse, heads, n_q, n_kv, head_dim, sm_scale * LOG2E, *q.stride(), *k.stride(),
        *v.stride(), *o.stride(), BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        HEAD_DIM=padded, CAUSAL=causal, PRECISION=dot_precision(q.dtype),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return o, lse


def attention_backward(q, k, v, o, lse, do, causal, sm_scale, launch_k=None, launch_q=None):
    batch, heads, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    padded = max(16, triton.next_power_of_2(head_dim))
    _, default_k, default_q = launches(padded, q.element_size())
    launch_k, launch_q = launch_k or default_k, launch_q or default_q
    delta = torch.empty_like(lse)
    output_dot_grad_kernel[(triton.cdiv(n_q, 64), batch * heads)](
        o, do, delta, heads, n_q, head_dim, *o.stride(), *do.stride(), BLOCK_M=64, HEAD_DIM=padded
    )
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=q.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
    common = (
        heads,
        n_q,
        n_kv,
        head_dim,
        sm_scale * LOG2E,
        sm_scale,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *do.stride(),
    )
    attention_key_grads_kernel[(triton.cdiv(n_kv, launch_k.block_n), batch * heads)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        *common,
        BLOCK_M=launch_k.block_m,
        BLOCK_N=launch_k.block_n,
        HEAD_DIM=padded,
        CAUSAL=causal,
        PRECISION=dot_precision(q.dtype),
        num_warps=launch_k.num_warps,
        num_stages=launch_k.num_stages,
    )
    attention_query_grad_kernel[(triton.cdiv(n_q, launch_q.block_m), batch * heads)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        *common,
        BLOCK_M=launch_q.block_m,
        BLOCK_N=launch_q.block_n,
        HEAD_DIM=padded,
        CAUSAL=causal,
        PRECISION=dot_precision(q.dtype),
        num_warps=launch_q.num_warps,
        num_stages=launch_q.num_stages,
    )
    return dq, dk, dv


def check_against_sdpa():
    """Forward and gradients against SDPA in fp64, odd sizes, causal and not (interpreter)."""
    import itertools

    import torch.nn.functional as F

    torch.manual_seed(0)
    torch.set_float32_matmul_precision("highest")
    for (n_q, n_kv), head_dim, causal in itertools.product(
        [(1, 1), (17, 17), (40, 40), (33, 50), (50, 33)], [16, 24, 64], [False, True]
    ):
        q, k, v = (torch.randn(2, 3, n, head_dim) for n in (n_q, n_kv, n_kv))
        o, lse = attention_forward(q, k, v, causal, head_dim**-0.5)
        exact = [t.double().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*exact, is_causal=causal, scale=head_dim**-0.5)
        do = torch.randn_like(want)
        grads = attention_backward(q, k, v, o, lse, do.float(), causal, head_dim**-0.5)
        wanted = torch.autograd.grad(want, exact, do)
        errors = [(o.double() - want).abs().max().item()]
        errors += [(g.double() - w).abs().max().item() for g, w in zip(grads, wanted, strict=True)]
        assert max(errors) < 1e-4, (n_q, n_kv, head_dim, causal, errors)
    print("attention draft matches SDPA in fp64: 30 cases, forward and gradients")


if __name__ == "__main__":
    if ON_GPU:
        print("on a GPU, run attention_sweep.py")
    else:
        check_against_sdpa()
