"""ops.long_rows: the code of chapter 13, Long rows: a layer norm split over programs."""

# Generated from tutorials/13-long-rows.py by tools/export.py: edit the chapter, then `make
# export`.

from stepkernels.runtime.core import INTERPRET
from stepkernels.runtime.device import profile
from stepkernels.runtime.launch import lean
from stepkernels.runtime.partials import flush_partials
from stepkernels.runtime.waiting import MAX_POLLS, publish, publish_and_wait, wait_for
import torch
import triton
import triton.language as tl


@triton.jit
def walked_statistics(x_row, N, BLOCK_N: tl.constexpr):
    """The way out: a row's mean and M2, walked in blocks merged by Chan's rule."""
    count, mean, m2 = 0.0, 0.0, 0.0
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        block_count = tl.minimum(N - start, BLOCK_N).to(tl.float32)
        block_mean = tl.sum(x, axis=0) / block_count
        deviation = tl.where(cols < N, x - block_mean, 0.0)
        total, delta = count + block_count, block_mean - mean
        mean += delta * (block_count / total)
        spread = delta * delta * count * block_count / total
        m2 += tl.sum(deviation * deviation, axis=0) + spread
        count = total
    return mean, m2


@lean
@triton.jit
def layer_norm_forward_split_kernel(
    x_ptr,  # x and y (M x N), weight and bias (N)
    y_ptr,
    weight_ptr,
    bias_ptr,
    mean_ptr,  # M fp32 each, written for the backward
    rstd_ptr,
    stats_ptr,  # (M, 2, CHUNKS_POW2) fp32: each chunk's mean and M2
    counter_ptr,  # M int32 zeros: the chunks of a row that have published
    x_row_stride,
    y_row_stride,
    N,
    n_chunks,  # programs a row
    eps,
    BLOCK_N: tl.constexpr,  # values a chunk
    CHUNKS_POW2: tl.constexpr,  # n_chunks rounded up to a power of two
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MAX_POLLS: tl.constexpr,  # reads of the counter before the way out
):
    row = (tl.program_id(0) // n_chunks).to(tl.int64)
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row, x_row = cols < N, x_ptr + row * x_row_stride
    x = tl.load(x_row + cols, mask=in_row, other=0.0).to(tl.float32)
    count = tl.minimum(N - chunk * BLOCK_N, BLOCK_N).to(tl.float32)
    chunk_mean = tl.sum(x, axis=0) / count
    deviation = tl.where(in_row, x - chunk_mean, 0.0)
    row_stats = stats_ptr + row * 2 * CHUNKS_POW2  # CHUNKS_POW2 means, then as many M2s
    tl.store(row_stats + chunk, chunk_mean)
    tl.store(row_stats + CHUNKS_POW2 + chunk, tl.sum(deviation * deviation, axis=0))
    if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):  # all pairs are there
        chunks = tl.arange(0, CHUNKS_POW2)
        present = chunks < n_chunks
        means = tl.load(row_stats + chunks, mask=present, other=0.0, volatile=True)
        m2s = tl.load(
            row_stats + CHUNKS_POW2 + chunks, mask=present, other=0.0, volatile=True
        )
        counts = tl.minimum(tl.maximum(N - chunks * BLOCK_N, 0), BLOCK_N).to(tl.float32)
        mean = tl.sum(means * counts, axis=0) / N
        m2 = tl.sum(m2s + counts * (means - mean) * (means - mean), axis=0)
    else:  # the row's other programs are not running
        mean, m2 = walked_statistics(x_row, N, BLOCK_N)
    rstd = 1.0 / tl.sqrt(m2 / N + eps)
    # Read the chunk again: it comes from L2, and registers no longer hold it while we wait
    x = tl.load(x_row + cols, mask=in_row, other=0.0).to(tl.float32)
    y = (x - mean) * rstd
    if HAS_WEIGHT:
        y *= tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    y_row = y_ptr + row * y_row_stride
    tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)
    if chunk == 0:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


def split_forward(tensors, strides, affine, n_rows, n_cols, eps, config):
    """Chapter 03's ``layer_norm_forward`` calls this for rows past
    ``FORWARD_MAX_BLOCK``: ``tensors`` are x, y, weight, bias, mean, rstd; ``config``
    holds BLOCK_N and num_warps."""
    device = tensors[0].device
    n_chunks = triton.cdiv(n_cols, config["BLOCK_N"])
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    stats = torch.empty((n_rows, 2, chunks_pow2), device=device, dtype=torch.float32)
    counters = torch.zeros(n_rows, device=device, dtype=torch.int32)  # one per row
    layer_norm_forward_split_kernel[(n_rows * n_chunks,)](
        *tensors,
        stats,
        counters,
        *strides,
        n_cols,
        n_chunks,
        eps,
        CHUNKS_POW2=chunks_pow2,
        MAX_POLLS=MAX_POLLS,
        **affine,
        **config,
    )


# PTX: NVIDIA's GPUs only; the interpreter runs no inline assembly
OPAQUE_MOVES = tl.constexpr(not INTERPRET and profile().nvidia)


@triton.jit
def opaque(x):
    """x, through a move the compiler cannot see into (16-bit values two a register)."""
    if OPAQUE_MOVES:
        pack: tl.constexpr = 2 if x.dtype.primitive_bitwidth == 16 else 1
        return tl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=pack
        )
    return x


@triton.jit
def load_rows(ptr, row_stride, rows, cols, mask):
    offsets = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@lean
@triton.jit
def layer_norm_backward_split_kernel(
    x_ptr,  # x, dy and dx (M x N), weight (N)
    dy_ptr,
    dx_ptr,
    weight_ptr,
    mean_ptr,  # M fp32 each, from the forward
    rstd_ptr,
    partial_ptr,  # dW and dB partial sums and locks, as in chapter 03's backward
    lock_ptr,
    sums_ptr,  # (M, 2, CHUNKS_POW2) fp32: each chunk's part of a row's two sums
    counter_ptr,  # int32 zeros: one counter a batch of rows
    x_row_stride,
    dy_row_stride,
    dx_row_stride,
    M,
    N,
    num_locks,
    n_chunks,  # programs a group of rows
    BLOCK_N: tl.constexpr,  # columns a chunk
    ROWS_PER_PROGRAM: tl.constexpr,  # rows a group
    BATCH: tl.constexpr,  # rows a batch: one publication and one wait for them all
    CHUNKS_POW2: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    REDUCTION: tl.constexpr,  # of dW and dB: "two-stage", "lock" or "none"
    GROUP_SIZE_M: tl.constexpr,
    MAX_POLLS: tl.constexpr,
):
    group, chunk = tl.program_id(0) // n_chunks, tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask, in_batch = cols < N, tl.arange(0, BATCH)
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw, db = tl.zeros([BLOCK_N], tl.float32), tl.zeros([BLOCK_N], tl.float32)
    narrow: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth < 32  # 16-bit x
    first = group * ROWS_PER_PROGRAM
    last = tl.minimum(first + ROWS_PER_PROGRAM, M)
    mask = (first + in_batch < last)[:, None] & col_mask[None, :]
    x_next = load_rows(x_ptr, x_row_stride, first + in_batch, cols, mask)
    dy_next = load_rows(dy_ptr, dy_row_stride, first + in_batch, cols, mask)
    for start in range(first, last, BATCH):
        rows = start + in_batch
        row_ok = rows < last
        x_held, dy_held = x_next, dy_next  # as loaded: all that crosses the wait
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        dy = dy_held.to(tl.float32)
        x_hat, wdy = (x_held.to(tl.float32) - mean) * rstd, w * dy if HAS_WEIGHT else dy
        # [row, 2, CHUNKS_POW2]: each chunk's part of the two sums of each row
        parts = sums_ptr + rows.to(tl.int64) * 2 * CHUNKS_POW2
        tl.store(parts + chunk, tl.sum(x_hat * wdy, axis=1), mask=row_ok)
        tl.store(parts + CHUNKS_POW2 + chunk, tl.sum(wdy, axis=1), mask=row_ok)
        if narrow:  # add the batch to dW and dB now: no fp32 value crosses the wait
            dw += tl.sum(dy * x_hat, axis=0)  # rows past the group: dy = 0
            db += tl.sum(dy, axis=0)
        batch = group * tl.cdiv(ROWS_PER_PROGRAM, BATCH) + (start - first) // BATCH
        publish(counter_ptr, batch)
        # The next batch's loads, in flight while we wait
        mask = (rows + BATCH < last)[:, None] & col_mask[None, :]
        x_next = load_rows(x_ptr, x_row_stride, rows + BATCH, cols, mask)
        dy_next = load_rows(dy_ptr, dy_row_stride, rows + BATCH, cols, mask)
        if wait_for(counter_ptr, batch, n_chunks, MAX_POLLS):
            chunks = tl.arange(0, CHUNKS_POW2)
            present = row_ok[:, None] & (chunks < n_chunks)[None, :]
            row_parts = parts[:, None] + chunks[None, :]
            sum_1 = tl.load(row_parts, mask=present, other=0.0, volatile=True)
            sum_2 = tl.load(
                row_parts + CHUNKS_POW2, mask=present, other=0.0, volatile=True
            )
            sum_1, sum_2 = tl.sum(sum_1, axis=1), tl.sum(sum_2, axis=1)
        else:  # the other chunks are not running: walk the batch's rows
            sum_1, sum_2 = tl.zeros([BATCH], tl.float32), tl.zeros([BATCH], tl.float32)
            for walk in range(0, N, BLOCK_N):
                walked = walk + tl.arange(0, BLOCK_N)
                mask = row_ok[:, None] & (walked < N)[None, :]
                x_walked = load_rows(x_ptr, x_row_stride, rows, walked, mask)
                x_hat_walked = (x_walked.to(tl.float32) - mean) * rstd
                wdy_walked = load_rows(dy_ptr, dy_row_stride, rows, walked, mask)
                wdy_walked = wdy_walked.to(tl.float32)
                if HAS_WEIGHT:
                    w_walked = tl.load(weight_ptr + walked, mask=walked < N, other=0.0)
                    wdy_walked *= w_walked.to(tl.float32)[None, :]
                sum_1 += tl.sum(x_hat_walked * wdy_walked, axis=1)
                sum_2 += tl.sum(wdy_walked, axis=1)
        if narrow:  # converted again (fp32: kept, the conversion was free)
            x_hat = (opaque(x_held).to(tl.float32) - mean) * rstd
            wdy = opaque(dy_held).to(tl.float32)
            if HAS_WEIGHT:
                wdy *= w
        dx = (wdy - (x_hat * (sum_1 / N)[:, None] + (sum_2 / N)[:, None])) * rstd
        dx_ptrs = dx_ptr + rows.to(tl.int64)[:, None] * dx_row_stride + cols[None, :]
        tl.store(
            dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=row_ok[:, None] & col_mask
        )
        if not narrow:
            dw += tl.sum(dy * x_hat, axis=0)
            db += tl.sum(dy, axis=0)
    if REDUCTION != "none":
        slot = group % GROUP_SIZE_M if REDUCTION == "lock" else group
        buffers = (partial_ptr, lock_ptr)
        slots = (slot, chunk * GROUP_SIZE_M + slot, num_locks)
        flush_partials(buffers, (dw, db), (cols, col_mask), N, slots, REDUCTION)


def split_backward(tensors, strides, options, n_rows, n_cols, num_locks, config):
    """Chapter 03's ``layer_norm_backward`` calls this for rows past
    ``BACKWARD_MAX_BLOCK``: ``tensors`` are x, dy, dx, weight, mean, rstd, partials,
    locks, as its own kernel takes."""
    device, rows_per_group = tensors[0].device, config["ROWS_PER_PROGRAM"]
    n_groups = triton.cdiv(n_rows, rows_per_group)
    n_chunks = triton.cdiv(n_cols, config["BLOCK_N"])
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    sums = torch.empty((n_rows, 2, chunks_pow2), device=device, dtype=torch.float32)
    batches = n_groups * triton.cdiv(rows_per_group, config["BATCH"])
    counters = torch.zeros(batches, device=device, dtype=torch.int32)  # one per batch
    layer_norm_backward_split_kernel[(n_groups * n_chunks,)](
        *tensors,
        sums,
        counters,
        *strides,
        n_rows,
        n_cols,
        num_locks,
        n_chunks,
        CHUNKS_POW2=chunks_pow2,
        MAX_POLLS=MAX_POLLS,
        **options,
        **config,
    )
