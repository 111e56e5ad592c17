"""A split-row layer-norm backward for long rows (issue 19's next step), checked and timed.

Written when chapter 03's backward held a whole row per program up to 16,384 columns (x, dy,
and the dW, dB accumulators in registers: 58 to 63% of a copy at N = 16,384) and walked longer
rows twice (47 to 57%); the batched kernel below became chapter 13's. Here, as in chapter 02's
split kernels, a row's columns are split into chunks: program (g, c) owns chunk c of the rows
of group g. For each of its rows it loads its chunk of x and dy once, publishes its part of the
two row sums (of x_hat * w * dy and of w * dy) with ``publish_and_wait``, reads the row's
totals, writes its chunk of dx, and adds the row to its chunk's dW and dB in registers; at the
end the group's partial dW, dB go to the package's second stage. If a sibling chunk never
publishes (after MAX_POLLS tries) the program walks the row itself: slower, same answer. Under
the interpreter, which runs programs one by one, every chunk but the last takes that path.

    python lab/layer_norm_split_backward.py [--quick | --batched | --reload]

``--batched`` times ``layer_norm_backward_batched_kernel`` instead: a program takes its group's
rows R at a time (one publication and one wait per R rows) and, with PREFETCH, loads the next
R rows before it waits. ``--reload`` times the batched kernel holding its batch across the
wait or, with RELOAD, reading it again from L2 after the wait (fewer registers).

Under the interpreter it checks against torch.autograd; on a GPU it also times it over rows
per group, chunk and warps, next to the package's backward and a copy of the same bytes.
"""

import functools
import itertools
import sys

from stepkernels.lessons import bench
from stepkernels.ops.layer_norm import layer_norm_backward, layer_norm_forward
from stepkernels.runtime.core import DEVICE, ON_GPU, dtype_name, sm_count
from stepkernels.runtime.partials import sum_partials_kernel
from stepkernels.runtime.waiting import MAX_POLLS, publish_and_wait
import torch
import triton
import triton.language as tl


@triton.jit
def row_sums(x_row, dy_row, w_ptr, mean, rstd, n_cols, BLOCK_N: tl.constexpr):
    """The fallback: sum(x_hat * w * dy) and sum(w * dy) over a whole row, walked."""
    lanes_1 = tl.zeros([BLOCK_N], tl.float32)
    lanes_2 = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        wdy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        wdy *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        lanes_1 += (x - mean) * rstd * wdy
        lanes_2 += wdy
    return tl.sum(lanes_1, axis=0), tl.sum(lanes_2, axis=0)


@triton.jit
def layer_norm_backward_split_kernel(
    x_ptr, dy_ptr, dx_ptr, w_ptr, mean_ptr, rstd_ptr, sums_ptr, counter_ptr, partial_ptr,
    n_rows, n_cols, n_chunks, row_stride,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS_POW2: tl.constexpr,
    MAX_POLLS: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0) // n_chunks
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    dw, db = tl.zeros([BLOCK_N], tl.float32), tl.zeros([BLOCK_N], tl.float32)
    for i in range(ROWS):
        row = group * ROWS + i
        if row < n_rows:
            row64 = row.to(tl.int64)
            x_row, dy_row = x_ptr + row64 * row_stride, dy_ptr + row64 * row_stride
            x = tl.load(x_row + cols, mask=in_row, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + cols, mask=in_row, other=0.0).to(tl.float32)
            mean, rstd = tl.load(mean_ptr + row), tl.load(rstd_ptr + row)
            x_hat, wdy = (x - mean) * rstd, w * dy
            # this chunk's parts of the two sums: [row, 0, chunk] and [row, 1, chunk]
            row_sums_ptr = sums_ptr + row64 * 2 * CHUNKS_POW2
            tl.store(row_sums_ptr + chunk, tl.sum(x_hat * wdy, axis=0))
            tl.store(row_sums_ptr + CHUNKS_POW2 + chunk, tl.sum(wdy, axis=0))
            if publish_and_wait(counter_ptr, row, n_chunks, MAX_POLLS):
                chunks = tl.arange(0, CHUNKS_POW2)
                present = chunks < n_chunks
                parts_1 = tl.load(row_sums_ptr + chunks, mask=present, other=0.0, volatile=True)
                parts_2 = tl.load(row_sums_ptr + CHUNKS_POW2 + chunks, mask=present, other=0.0,
                                  volatile=True)  # fmt: skip
                sum_1, sum_2 = tl.sum(parts_1, axis=0), tl.sum(parts_2, axis=0)
            else:  # the siblings are not running: walk the row ourselves
                sum_1, sum_2 = row_sums(x_row, dy_row, w_ptr, mean, rstd, n_cols, BLOCK_N)
            dx = (wdy - (x_hat * (sum_1 / n_cols) + sum_2 / n_cols)) * rstd
            tl.store(dx_ptr + row64 * row_stride + cols, dx.to(dx_ptr.dtype.element_ty),
                     mask=in_row)  # fmt: skip
            dw += dy * x_hat
            db += dy
    partial = partial_ptr + group.to(tl.int64) * 2 * n_cols  # the package's two-stage layout
    tl.store(partial + cols, dw, mask=in_row)
    tl.store(partial + n_cols + cols, db, mask=in_row)


def layer_norm_backward_split(dy, x, weight, mean, rstd, rows=16, chunk=4096, num_warps=4):
    """dx, dW, dB for contiguous 2-D x and dy and a weight (this sketch always has one)."""
    n_rows, n_cols = x.shape
    n_chunks = triton.cdiv(n_cols, chunk)
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    n_groups = triton.cdiv(n_rows, rows)
    sums = torch.empty(n_rows, 2, chunks_pow2, device=x.device)
    counters = torch.zeros(n_rows, device=x.device, dtype=torch.int32)
    partials = torch.empty(n_groups, 2, n_cols, device=x.device)
    dx = torch.empty_like(x)
    dw, db = torch.empty_like(weight), torch.empty_like(weight)
    layer_norm_backward_split_kernel[(n_groups * n_chunks,)](
        x, dy, dx, weight, mean, rstd, sums, counters, partials, n_rows, n_cols, n_chunks,
        x.stride(0), ROWS=rows, BLOCK_N=chunk, CHUNKS_POW2=chunks_pow2, MAX_POLLS=MAX_POLLS,
        num_warps=num_warps,
    )  # fmt: skip
    block_n = min(128, max(16, triton.next_power_of_2(triton.cdiv(n_cols, 2 * sm_count()))))
    sum_partials_kernel[(triton.cdiv(n_cols, block_n),)](
        partials, partials, dw, db, n_groups, n_cols, HAS_COUNTS=False, HAS_DW=True,
        HAS_DB=True, BLOCK_P=32, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return dx, dw, db


@triton.jit
def load_batch(x_ptr, dy_ptr, rows, cols, row_ok, in_row, row_stride):
    offsets = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    mask = row_ok[:, None] & in_row[None, :]
    return tl.load(x_ptr + offsets, mask=mask, other=0.0), tl.load(dy_ptr + offsets, mask=mask, other=0.0)


@triton.jit
def layer_norm_backward_batched_kernel(
    x_ptr, dy_ptr, dx_ptr, w_ptr, mean_ptr, rstd_ptr, sums_ptr, counter_ptr, partial_ptr,
    n_rows, n_cols, n_chunks, row_stride, rows_per_group,
    R: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS_POW2: tl.constexpr,
    MAX_POLLS: tl.constexpr, PREFETCH: tl.constexpr, RELOAD: tl.constexpr = False,
):  # fmt: skip
    """The split backward over batches of R rows: one publication and one wait per batch, and
    with PREFETCH the next batch's x and dy are loaded before the wait."""
    group = tl.program_id(0) // n_chunks
    chunk = tl.program_id(0) % n_chunks
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    dw, db = tl.zeros([BLOCK_N], tl.float32), tl.zeros([BLOCK_N], tl.float32)
    first = group * rows_per_group
    last = tl.minimum(first + rows_per_group, n_rows)
    batch_rows = tl.arange(0, R)
    chunks = tl.arange(0, CHUNKS_POW2)
    x_next, dy_next = load_batch(x_ptr, dy_ptr, first + batch_rows, cols, first + batch_rows < last,
                                 in_row, row_stride)  # fmt: skip
    for start in range(first, last, R):
        rows = start + batch_rows
        row_ok = rows < last
        if PREFETCH:
            x, dy = x_next, dy_next
        else:
            x, dy = load_batch(x_ptr, dy_ptr, rows, cols, row_ok, in_row, row_stride)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        x_hat = (x - mean[:, None]) * rstd[:, None]
        wdy = w[None, :] * dy
        row_sums_ptr = sums_ptr + rows.to(tl.int64) * 2 * CHUNKS_POW2
        tl.store(row_sums_ptr + chunk, tl.sum(x_hat * wdy, axis=1), mask=row_ok)
        tl.store(row_sums_ptr + CHUNKS_POW2 + chunk, tl.sum(wdy, axis=1), mask=row_ok)
        tl.debug_barrier()  # every thread of this program has stored
        batch = start // R
        tl.atomic_add(counter_ptr + batch, 1, sem="release")
        if PREFETCH:  # issued before the wait: in flight while the siblings catch up
            x_next, dy_next = load_batch(x_ptr, dy_ptr, rows + R, cols, rows + R < last, in_row,
                                         row_stride)  # fmt: skip
        published = tl.atomic_add(counter_ptr + batch, 0, sem="acquire")
        polls = 0
        while (published < n_chunks) & (polls < MAX_POLLS):
            published = tl.atomic_add(counter_ptr + batch, 0, sem="acquire")
            polls += 1
        if published >= n_chunks:
            present = row_ok[:, None] & (chunks < n_chunks)[None, :]
            parts = row_sums_ptr[:, None] + chunks[None, :]
            sum_1 = tl.sum(tl.load(parts, mask=present, other=0.0, volatile=True), axis=1)
            sum_2 = tl.sum(tl.load(parts + CHUNKS_POW2, mask=present, other=0.0, volatile=True), axis=1)
        else:  # the siblings are not running: walk each row ourselves
            sum_1, sum_2 = tl.zeros([R], tl.float32), tl.zeros([R], tl.float32)
            for i in tl.static_range(R):
                row = tl.minimum(start + i, n_rows - 1)
                row64 = row.to(tl.int64)
                s1, s2 = row_sums(x_ptr + row64 * row_stride, dy_ptr + row64 * row_stride, w_ptr,
                                  tl.load(mean_ptr + row), tl.load(rstd_ptr + row), n_cols, BLOCK_N)  # fmt: skip
                sum_1, sum_2 = tl.where(batch_rows == i, s1, sum_1), tl.where(batch_rows == i, s2, sum_2)
        if RELOAD:  # read the batch again, from L2, rather than hold it across the wait
            x, dy = load_batch(x_ptr, dy_ptr, rows, cols, row_ok, in_row, row_stride)
            x, dy = x.to(tl.float32), dy.to(tl.float32)
            x_hat, wdy = (x - mean[:, None]) * rstd[:, None], w[None, :] * dy
        dx = (wdy - (x_hat * (sum_1 / n_cols)[:, None] + (sum_2 / n_cols)[:, None])) * rstd[:, None]
        offsets = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=row_ok[:, None] & in_row[None, :])
        dw += tl.sum(dy * x_hat, axis=0)  # rows past the group: dy = 0
        db += tl.sum(dy, axis=0)
    partial = partial_ptr + group.to(tl.int64) * 2 * n_cols
    tl.store(partial + cols, dw, mask=in_row)
    tl.store(partial + n_cols + cols, db, mask=in_row)


REGISTERS = {}  # launch -> registers per thread


def layer_norm_backward_batched(dy, x, weight, mean, rstd, rows=64, batch=2, chunk=2048, num_warps=8,
                                prefetch=True, reload=False):  # fmt: skip
    """The batched split backward; ``rows`` per group must be a multiple of ``batch``."""
    n_rows, n_cols = x.shape
    n_chunks = triton.cdiv(n_cols, chunk)
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    n_groups = triton.cdiv(n_rows, rows)
    sums = torch.empty(n_rows, 2, chunks_pow2, device=x.device)
    counters = torch.zeros(triton.cdiv(n_rows, batch), device=x.device, dtype=torch.int32)
    partials = torch.empty(n_groups, 2, n_cols, device=x.device)
    dx = torch.empty_like(x)
    dw, db = torch.empty_like(weight), torch.empty_like(weight)
    compiled = layer_norm_backward_batched_kernel[(n_groups * n_chunks,)](
        x, dy, dx, weight, mean, rstd, sums, counters, partials, n_rows, n_cols, n_chunks,
        x.stride(0), rows, R=batch, BLOCK_N=chunk, CHUNKS_POW2=chunks_pow2, MAX_POLLS=MAX_POLLS,
        PREFETCH=prefetch, RELOAD=reload, num_warps=num_warps,
    )  # fmt: skip
    REGISTERS[(x.dtype, batch, chunk, num_warps, prefetch, reload)] = getattr(compiled, "n_regs", None)
    block_n = min(128, max(16, triton.next_power_of_2(triton.cdiv(n_cols, 2 * sm_count()))))
    sum_partials_kernel[(triton.cdiv(n_cols, block_n),)](
        partials, partials, dw, db, n_groups, n_cols, HAS_COUNTS=False, HAS_DW=True,
        HAS_DB=True, BLOCK_P=32, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return dx, dw, db


def inputs(n_rows, n_cols, dtype, generator=None):
    x = torch.randn(n_rows, n_cols, generator=generator).to(DEVICE, dtype)
    w = (torch.rand(n_cols, generator=generator) + 0.5).to(DEVICE, dtype)
    b = torch.randn(n_cols, generator=generator).to(DEVICE, dtype)
    dy = torch.randn(n_rows, n_cols, generator=generator).to(DEVICE, dtype)
    _, mean, rstd = layer_norm_forward(x, w, b, 1e-5)
    return x, w, b, dy, mean, rstd


def check():
    generator = torch.Generator().manual_seed(0)
    for n_rows, n_cols, rows, chunk in [(5, 100, 2, 32), (3, 64, 4, 64), (7, 33, 3, 16)]:
        x, w, b, dy, mean, rstd = inputs(n_rows, n_cols, torch.float32, generator)
        leaves = [t.double().requires_grad_() for t in (x, w, b)]
        y = torch.nn.functional.layer_norm(leaves[0], (n_cols,), leaves[1], leaves[2], 1e-5)
        expected = torch.autograd.grad(y, leaves, dy.double())
        for got in (
            layer_norm_backward_split(dy, x, w, mean, rstd, rows=rows, chunk=chunk),
            layer_norm_backward_batched(dy, x, w, mean, rstd, rows=2 * rows, batch=2, chunk=chunk),
            layer_norm_backward_batched(
                dy, x, w, mean, rstd, rows=4, batch=4, chunk=chunk, prefetch=False
            ),  # fmt: skip
            layer_norm_backward_batched(dy, x, w, mean, rstd, rows=4, batch=2, chunk=chunk, reload=True),
        ):
            for name, a, e in zip(("dx", "dw", "db"), got, expected, strict=True):
                torch.testing.assert_close(a, e.float(), rtol=1e-4, atol=1e-4, msg=name)
    print("split-row layer-norm backwards (per row, batched) match torch.autograd (fp32)")


def sweep(dtype, n_cols, n_rows=4096, grid=((8, 16, 32), (2048, 4096, 8192), (4, 8))):
    x, w, _, dy, mean, rstd = inputs(n_rows, n_cols, dtype)
    nbytes = 3 * x.numel() * x.element_size()  # x and dy read, dx written
    calls = {
        "copy": bench.copy_of(nbytes),
        "package": lambda: layer_norm_backward(dy, x, w, mean, rstd),
    }
    for rows, chunk, warps in itertools.product(*grid):
        calls[f"{rows}r/{chunk}/{warps}w"] = lambda r=rows, c=chunk, nw=warps: layer_norm_backward_split(
            dy, x, w, mean, rstd, rows=r, chunk=c, num_warps=nw
        )
    rates = {}
    for name, fn in calls.items():
        try:
            rates[name] = bench.rate(nbytes, fn)
        except Exception as error:  # too large for registers or shared memory
            print(f"  {name}: {type(error).__name__}")
    best = sorted((r, n) for n, r in rates.items() if n not in ("copy", "package"))[::-1][:5]
    shown = "  ".join(f"{n} {r:.0f}" for r, n in best)
    print(f"{dtype_name(dtype):8} N={n_cols:6}: copy {rates['copy']:.0f} package "
          f"{rates['package']:.0f} | {shown}", flush=True)  # fmt: skip


BATCHED = (
    (1, 4096, 8),
    (2, 2048, 8),
    (2, 4096, 8),
    (2, 4096, 16),
    (4, 1024, 4),
    (4, 2048, 8),
    (8, 1024, 8),
)  # rows per batch, chunk, warps


def sweep_batched(dtype, n_cols, n_rows=4096):
    x, w, _, dy, mean, rstd = inputs(n_rows, n_cols, dtype)
    nbytes = 3 * x.numel() * x.element_size()
    calls = {"copy": bench.copy_of(nbytes), "package": lambda: layer_norm_backward(dy, x, w, mean, rstd)}
    for (batch, chunk, warps), rows, prefetch in itertools.product(BATCHED, (32, 64, 128), (True, False)):
        if chunk <= triton.next_power_of_2(n_cols):
            name = f"{rows}r/{batch}b/{chunk}/{warps}w{' prefetch' if prefetch else ''}"
            calls[name] = lambda k=(rows, batch, chunk, warps, prefetch): layer_norm_backward_batched(
                dy, x, w, mean, rstd, *k
            )
    rates = {}
    for name, fn in calls.items():
        try:
            rates[name] = bench.rate(nbytes, fn)
        except Exception as error:
            print(f"  {name}: {type(error).__name__} {str(error).splitlines()[0][:80]}")
    best = sorted((r, n) for n, r in rates.items() if n not in ("copy", "package"))[::-1][:6]
    shown = "  ".join(f"{n} {r:.0f}" for r, n in best)
    print(f"{dtype_name(dtype):8} N={n_cols:6}: copy {rates['copy']:.0f} package "
          f"{rates['package']:.0f} | {shown}", flush=True)  # fmt: skip


RELOAD_LAUNCHES = ((4, 1024, 4), (2, 1024, 4), (4, 1024, 8), (8, 1024, 8))  # batch, chunk, warps


def sweep_reload(dtype, n_cols, n_rows=4096):
    """Batches held across the wait, or read again from L2 after it (fewer registers)."""
    x, w, _, dy, mean, rstd = inputs(n_rows, n_cols, dtype)
    nbytes = 3 * x.numel() * x.element_size()
    shown = [f"copy {bench.rate(nbytes, bench.copy_of(nbytes)):.0f}"]
    for (batch, chunk, warps), reload in itertools.product(RELOAD_LAUNCHES, (False, True)):
        call = functools.partial(
            layer_norm_backward_batched, dy, x, w, mean, rstd, 128, batch, chunk, warps, True, reload
        )
        rate = bench.rate(nbytes, call)
        regs = REGISTERS.get((x.dtype, batch, chunk, warps, True, reload))
        shown.append(f"{batch}b/{chunk}/{warps}w{' reload' if reload else ''} {rate:.0f} ({regs} regs)")
    print(f"{dtype_name(dtype):8} N={n_cols:6}: " + "  ".join(shown), flush=True)


if __name__ == "__main__":
    check()
    if ON_GPU and "--reload" in sys.argv:
        with bench.side_stream():
            for dtype, n_cols in itertools.product((torch.float16, torch.float32), (16384, 65536)):
                sweep_reload(dtype, n_cols)
        sys.exit()
    if ON_GPU and "--batched" in sys.argv:
        with bench.side_stream():
            for dtype, n_cols in itertools.product((torch.float16, torch.float32), (4096, 16384, 65536)):
                sweep_batched(dtype, n_cols)
        sys.exit()
    if ON_GPU and "--quick" in sys.argv:  # a first look: fp16, two sizes, four launches
        for n_cols in (16384, 65536):
            sweep(torch.float16, n_cols, grid=((16,), (4096, 8192), (4, 8)))
    elif ON_GPU:
        for dtype in (torch.float16, torch.float32):
            for n_cols in (4096, 16384, 32768, 65536):
                sweep(dtype, n_cols)
