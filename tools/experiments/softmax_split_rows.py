"""An experiment for chapter 02's long rows: split each row over several programs.

The chapter's looped kernel reads a long row twice (once for the maximum and the sum, once to
write), so at best it moves 3 M N bytes for the 2 M N we count, and on the H100 it reached about
1.45 TB/s counted. Here each program loads one chunk of a row into registers, computes the
chunk's maximum and sum of exponentials, and publishes them; once every chunk of its row has
published, it combines them and writes its chunk from registers: x is read once.

The programs of a row wait for one another through a counter per row (an atomic add with
release semantics after the chunk's statistics are stored, polled with acquire semantics).
Waiting on other programs can deadlock when they are not running at the same time, as under
the interpreter, which runs programs one after another. So a program polls a bounded number
of times and then computes the whole row's statistics itself, reading the row: always correct,
and on a GPU, where a row's programs are launched together, rarely needed.

Run it (under the interpreter it checks correctness at small sizes; on a GPU it also times
the kernel against the chapter's looped kernel and torch):

    PYTHONPATH=tutorials python tools/experiments/softmax_split_rows.py
"""

import kit
import torch
import triton
import triton.language as tl

chapter = kit.load_chapter("02")


@triton.jit
def softmax_split_rows_kernel(
    x_ptr,
    y_ptr,
    max_ptr,
    sum_ptr,
    counter_ptr,
    n_cols,
    n_chunks,
    x_row_stride,
    y_row_stride,
    target,
    CHUNK: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
    LOG: tl.constexpr,
    MAX_POLLS: tl.constexpr,
):
    row = tl.program_id(0) // n_chunks
    chunk = tl.program_id(0) % n_chunks
    row64 = row.to(tl.int64)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = cols < n_cols
    x = tl.load(x_ptr + row64 * x_row_stride + cols, mask=in_row, other=-float("inf"))
    x = x.to(tl.float32)
    chunk_max = tl.max(x, axis=0)
    shift = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
    chunk_sum = tl.sum(tl.exp(x - shift), axis=0)
    tl.store(max_ptr + row64 * CHUNKS_POW2 + chunk, chunk_max)
    tl.store(sum_ptr + row64 * CHUNKS_POW2 + chunk, chunk_sum)
    # Publish: the stores above become visible before the count does (release). The barrier
    # first, in case the thread that stored is not the one that adds (as in chapter 03's lock).
    tl.debug_barrier()
    tl.atomic_add(counter_ptr + row, 1, sem="release")
    seen = tl.atomic_add(counter_ptr + row, 0, sem="acquire")
    polls = 0
    while (seen < target) & (polls < MAX_POLLS):
        seen = tl.atomic_add(counter_ptr + row, 0, sem="acquire")
        polls += 1
    if seen >= target:
        # Every chunk has published: combine their (max, sum) pairs. volatile: skip L1, which
        # may hold lines from before the other programs wrote.
        chunks = tl.arange(0, CHUNKS_POW2)
        maxima = tl.load(
            max_ptr + row64 * CHUNKS_POW2 + chunks,
            mask=chunks < n_chunks,
            other=-float("inf"),
            volatile=True,
        )
        sums = tl.load(sum_ptr + row64 * CHUNKS_POW2 + chunks, mask=chunks < n_chunks, other=0.0, volatile=True)
        row_max = tl.max(maxima, axis=0)
        row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
        chunk_shifts = tl.where(maxima == -float("inf"), 0.0, maxima)
        row_sum = tl.sum(sums * tl.exp(chunk_shifts - row_shift), axis=0)
    else:
        # The others are not running (the interpreter) or are late: read the row ourselves.
        row_max = -float("inf")
        lane_sum = tl.zeros([CHUNK], tl.float32)
        for start in range(0, n_cols, CHUNK):
            offsets = start + tl.arange(0, CHUNK)
            part = tl.load(x_ptr + row64 * x_row_stride + offsets, mask=offsets < n_cols, other=-float("inf"))
            part = part.to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(part, axis=0))
            new_shift = tl.where(new_max == -float("inf"), 0.0, new_max)
            old_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
            lane_sum = lane_sum * tl.exp(old_shift - new_shift) + tl.exp(part - new_shift)
            row_max = new_max
        row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
        row_sum = tl.sum(lane_sum, axis=0)
    if LOG:
        y = (x - row_max) - tl.log(row_sum)
    else:
        y = tl.exp(x - row_shift) / row_sum
    tl.store(y_ptr + row64 * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


_buffers = {}


def softmax_split_rows(x, log=False, chunk=8192, num_warps=8, max_polls=None):
    """Softmax over the last dimension of a 2-D x with rows split into chunks of ``chunk``."""
    n_rows, n_cols = x.shape
    n_chunks = triton.cdiv(n_cols, chunk)
    chunks_pow2 = triton.next_power_of_2(n_chunks)
    key = (x.device, n_rows, chunks_pow2)
    if key not in _buffers:  # statistics, and a counter per row that only ever grows
        stats = torch.empty(2, n_rows, chunks_pow2, device=x.device, dtype=torch.float32)
        _buffers[key] = [stats, torch.zeros(n_rows, device=x.device, dtype=torch.int32), 0]
    stats, counters, calls = _buffers[key]
    _buffers[key][2] = calls = calls + 1
    # Each call adds n_chunks to every row's counter: this call's row is complete at
    # calls * n_chunks. (The counters wrap after 2**31 / n_chunks calls; reset them before.)
    target = calls * n_chunks
    y = torch.empty_like(x)
    softmax_split_rows_kernel[(n_rows * n_chunks,)](
        x, y, stats[0], stats[1], counters, n_cols, n_chunks, x.stride(0), y.stride(0), target,
        CHUNK=chunk, CHUNKS_POW2=chunks_pow2, LOG=log,
        MAX_POLLS=max_polls if max_polls is not None else kit.choose(gpu=100_000, cpu=2),
        num_warps=num_warps,
    )  # fmt: skip
    return y


def check():
    generator = torch.Generator().manual_seed(0)
    for n_rows, n_cols, chunk in [(3, 100, 16), (2, 4096, 512), (5, 33, 64), (1, 1, 16)] + kit.choose(
        gpu=[(256, 262_144, 8192), (1024, 65_536, 4096)], cpu=[]
    ):
        for dtype in (torch.float32, torch.float16):
            x = (torch.randn(n_rows, n_cols, generator=generator) * 4).to(kit.DEVICE, dtype)
            x[0, : n_cols // 2] = -float("inf")  # a row that starts masked
            for log in (False, True):
                for _ in range(2):  # the second call checks the counters' epochs
                    y = softmax_split_rows(x, log, chunk=chunk, num_warps=4 if chunk <= 1024 else 8)
                    expected = chapter.reference(x, log)
                    torch.testing.assert_close(y, expected, **chapter.TOLERANCES[dtype])
    print("softmax_split_rows matches torch (fp32, fp16; softmax and log-softmax)")


def bench_one(x):
    nbytes = 2 * x.numel() * x.element_size()
    calls = {
        "looped (chapter)": lambda: chapter.softmax_forward(x),
        "torch": lambda: torch.softmax(x, -1),
    }
    for chunk in (4096, 8192, 16384):
        for warps in (8, 16):
            calls[f"split {chunk}/{warps}w"] = lambda c=chunk, w=warps: softmax_split_rows(x, chunk=c, num_warps=w)
    line = f"{kit.dtype_name(x.dtype):8} N={x.shape[1]:7}"
    for name, fn in calls.items():
        line += f"  {name} {nbytes / triton.testing.do_bench(fn) / 1e6:6.0f}"
    print(line, flush=True)


def bench():
    for dtype in (torch.float32, torch.float16):
        for n_cols in (65_536, 131_072, 262_144):
            bench_one(torch.randn(2**26 // n_cols, n_cols, device="cuda", dtype=dtype))


check()
if kit.ON_GPU:
    bench()
